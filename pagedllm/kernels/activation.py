"""SiLU-and-mul: the gated MLP activation, silu(x[..., :d]) * x[..., d:]. The Triton version
lives in activation_triton.py; `silu_and_mul` uses it for CUDA tensors."""

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
