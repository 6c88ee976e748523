"""SiLU-and-mul: the gated MLP activation, silu(x[..., :d]) * x[..., d:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2 * d] -> [T, d]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_torch(x)
