"""RMSNorm and LayerNorm as modules; the math lives in pagedllm.kernels.norm and
pagedllm.kernels.layernorm (torch references + Triton)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels.layernorm import fused_add_layer_norm, layer_norm
from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

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
