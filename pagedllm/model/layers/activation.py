"""Gated activation modules over pagedllm.kernels.activation."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.activation import gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)
