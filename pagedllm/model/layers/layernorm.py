"""RMSNorm and LayerNorm as modules; the math lives in pagedllm.kernels.norm and
pagedllm.kernels.layernorm (torch references + Triton).

`norm_into(norm, x, residual, linear)` is `norm(x, residual)`, except where `linear` (the one
consumer of the normed rows) multiplies per-token FP8 rows (an FP8 layer's W8A8 product): there
an RMSNorm's kernel writes those rows itself (kernels/norm.rms_norm_fp8), no 16-bit norm and no
quantization kernel. Opt-in until a device times it: PAGEDLLM_FUSED_NORM_FP8=1 (read when the norm
is built); off, norm_into is the norm."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels._triton import fusion_enabled
from pagedllm.kernels.fp8 import Fp8Rows
from pagedllm.kernels.layernorm import fused_add_layer_norm, layer_norm
from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fp8_rows = fusion_enabled("NORM_FP8", default=False)  # norm_into may quantize in this kernel

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and (by default) a bias; called like RMSNorm, with the residual
    add fused when a residual is given. The math lives in pagedllm.kernels.layernorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return layer_norm(x, self.weight, self.bias, self.eps)
        return fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)


def norm_into(
    norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, linear: nn.Module | None
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) without a residual; the normed rows as
    `Fp8Rows` from the norm's kernel where `linear` takes them (`linear.takes_fp8_rows`) and the norm
    is a plain RMSNorm (a subclass, e.g. Gemma's 1 + w, keeps its own forward)."""
    if linear is not None and type(norm) is RMSNorm and norm.fp8_rows and linear.takes_fp8_rows(x):
        rows, res = rms_norm_fp8(x, residual, norm.weight, norm.eps)
        return rows, (x if res is None else res)
    if residual is None:
        return norm(x), x
    return norm(x, residual)
