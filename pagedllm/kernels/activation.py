"""Gated MLP activations: SiLU-and-mul, silu(x[..., :d]) * x[..., d:], and GELU(tanh)-and-mul,
gelu_tanh(x[..., :d]) * x[..., d:] (Gemma's GeGLU). The Triton versions live in
activation_triton.py; the dispatchers use them for CUDA tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels._triton import use_triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * d] -> [T, d]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from pagedllm.kernels.activation_triton import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * d] -> [T, d]; HF's gelu_pytorch_tanh(gate) * up
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from pagedllm.kernels.activation_triton import gelu_tanh_and_mul_triton

        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_torch(x)


def act_and_mul_fp8(x: torch.Tensor, gelu_tanh: bool = False):
    """The gated activation of x [T, 2 * d] quantized per token for a W8A8 product: fp8.Fp8Rows
    with `per_token_quant_torch(silu_and_mul(x))`'s values (GELU's with gelu_tanh), computed in one
    Triton kernel on CUDA (activation_triton.act_and_mul_fp8_triton, rows of at most FP8_MAX_D);
    otherwise the activation, then fp8.fp8_rows."""
    from pagedllm.kernels.fp8 import Fp8Rows, fp8_rows

    if use_triton(x) and x.dim() == 2:
        from pagedllm.kernels.activation_triton import FP8_MAX_D, act_and_mul_fp8_triton

        if x.shape[-1] // 2 <= FP8_MAX_D:
            return Fp8Rows(*act_and_mul_fp8_triton(x, gelu_tanh), x.dtype)
    return fp8_rows((gelu_tanh_and_mul if gelu_tanh else silu_and_mul)(x))
