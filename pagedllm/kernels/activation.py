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
