"""RMSNorm, optionally fused with the residual add that precedes it (HF Llama numerics:
computed in float32, cast back before the weight multiply). The Triton versions live in
norm_triton.py; `rms_norm` and `fused_add_rms_norm` use them for CUDA tensors, and the C
kernel of cpu_kernels.py for float32 rows on the CPU."""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels._triton import use_triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H], weight: [H]
    dtype = x.dtype
    if dtype == torch.float32 == weight.dtype and x.device.type == "cpu":
        # one fused op, bit-identical to the lines below in float32 (no casts to make)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from pagedllm.kernels.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    out = cpu_kernels.rms_norm(x, weight, eps) if x.device.type == "cpu" else None
    return out if out is not None else rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    out = cpu_kernels.rms_norm(x, weight, eps, residual) if x.device.type == "cpu" else None
    return out if out is not None else fused_add_rms_norm_torch(x, residual, weight, eps)


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(fp8.Fp8Rows of rms_norm(x [+ residual]) quantized per token, x + residual or None): one Triton
    kernel on CUDA for 2-D rows and a weight of x's dtype (norm_triton.rms_norm_fp8_triton), else
    the norm, then fp8.fp8_rows."""
    from pagedllm.kernels.fp8 import Fp8Rows, fp8_rows

    if use_triton(x) and x.dim() == 2 and weight.dtype == x.dtype:
        from pagedllm.kernels.norm_triton import rms_norm_fp8_triton

        (q, s), res = rms_norm_fp8_triton(x, residual, weight, eps)
        return Fp8Rows(q, s, x.dtype), res
    if residual is None:
        return fp8_rows(rms_norm(x, weight, eps)), None
    y, res = fused_add_rms_norm(x, residual, weight, eps)
    return fp8_rows(y), res
