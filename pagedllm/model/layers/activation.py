"""Gated activation modules over pagedllm.kernels.activation.

`act_into(act, linear, h)` is `linear(act(h))`, except where the linear multiplies per-token FP8
rows (an FP8 layer's W8A8 product): there the activation's kernel writes those rows itself
(kernels/activation.act_and_mul_fp8), and no 16-bit product nor quantization kernel is made;
PAGEDLLM_FUSED_ACT_FP8=0 (read when the module is built) keeps the two kernels."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels._triton import fusion_enabled
from pagedllm.kernels.activation import act_and_mul_fp8, gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    gelu_tanh = False

    def __init__(self) -> None:
        super().__init__()
        self.fp8_rows = fusion_enabled("ACT_FP8")  # act_into may quantize in this kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(SiluAndMul):
    """GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`)."""

    gelu_tanh = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


def act_into(act: SiluAndMul, linear: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """linear(act(h)) for h [T, 2 * d], the FP8 rows made by the activation's kernel where
    `linear.takes_fp8_rows(h)`."""
    if act.fp8_rows and linear.takes_fp8_rows(h):
        return linear(act_and_mul_fp8(h, act.gelu_tanh))
    return linear(act(h))
