"""LayerNorm (mean and variance, weight and optional bias), optionally fused with the residual
add that precedes it: the GPT-2 / GPT-NeoX / StarCoder2 norm. Computed in float32 and rounded
once to the input dtype (what torch's CUDA layer norm does for 16-bit inputs); in float32 it is
exactly `F.layer_norm`. The Triton versions live in layernorm_triton.py; `layer_norm` and
`fused_add_layer_norm` use them for CUDA tensors and the torch references elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels._triton import use_triton


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # x: [T, H], weight / bias: [H]
    hidden = (x.shape[-1],)
    if x.dtype == torch.float32 == weight.dtype:
        return F.layer_norm(x, hidden, weight, bias, eps)
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), hidden, weight.float(), b, eps).to(x.dtype)


def fused_add_layer_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual); the sum is rounded to the input dtype."""
    residual = x + residual
    return layer_norm_torch(residual, weight, bias, eps), residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if use_triton(x):
        from pagedllm.kernels.layernorm_triton import layer_norm_triton

        return layer_norm_triton(x, weight, bias, eps)
    return layer_norm_torch(x, weight, bias, eps)


def fused_add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from pagedllm.kernels.layernorm_triton import fused_add_layer_norm_triton

        return fused_add_layer_norm_triton(x, residual, weight, bias, eps)
    return fused_add_layer_norm_torch(x, residual, weight, bias, eps)
