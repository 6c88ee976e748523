"""Gated activation modules over pagedllm.kernels.activation.

`act_into(act, linear, h)` is `linear(act(h))`, except where the linear multiplies per-token FP8
rows (an FP8 layer's W8A8 product): there the activation's kernel writes those rows itself
(kernels/activation.act_and_mul_fp8), and no 16-bit product nor quantization kernel is made;
PAGEDLLM_FUSED_ACT_FP8=0 (read when the module is built) keeps the two kernels.

`gated_into(act, gate_up, down, x)` is `act_into(act, down, gate_up(x))`, except that with
PAGEDLLM_FUSED_GATED_GEMV=1 (opt-in, not yet timed on a GPU) a 4-bit gate_up whose few rows take
the gemvp GEMV in one split stores act(gate) * up itself (kernels/wna16.wna16_gated_linear): no
activation kernel, nor the [T, 2 * d] product it reads."""

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
        self.gated_gemv = fusion_enabled("GATED_GEMV", default=False)  # gated_into: gate_up's GEMV does it

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


def gated_into(act: SiluAndMul, gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate_up(x))) for gate_up's [T, 2 * d] [gate | up] output: one kernel for the
    product and the activation where `act.gated_gemv` and gate_up has one (`gated`), else act_into."""
    if act.gated_gemv:
        h = gate_up.gated(x, act.gelu_tanh)
        if h is not None:
            return down(h)
    return act_into(act, down, gate_up(x))
