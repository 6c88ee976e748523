"""Triton RMSNorm and fused residual-add + RMSNorm; they must equal `rms_norm_torch` and
`fused_add_rms_norm_torch` in norm.py. One program per row; the row lives in registers. Rows
need not be flattenable: q/k heads [T, H, D] sliced from a fused qkv projection are read in
place (a token stride and a head stride), not copied first.

Numerics follow the reference step by step: the residual sum is rounded to the input dtype, the
norm is computed in float32 and rounded to the input dtype, then multiplied by the weight (the
product of two 16-bit floats is exact in float32, so one final rounding matches torch's)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] residual in (only read when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H] normed out
    res_out_ptr,  # [T, H] x + residual out (only written when HAS_RESIDUAL)
    stride_x,  # row t of x at (t // inner) * stride_x + (t % inner) * stride_x_inner
    stride_x_inner,
    inner,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
):
    pdl_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + (row // inner) * stride_x + (row % inner) * stride_x_inner + cols, mask=mask, other=0.0)
    in_dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    y = (xf * tl.rsqrt(var + eps)).to(in_dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _strided_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x, outer row stride, inner row stride, rows per outer step) for x [..., R, H] whose
    rows cannot be flattened without a copy but whose last two dims can be walked in place:
    q or k heads [T, Hq, D] split from a fused qkv projection (a stride per token and one per
    head), as Qwen3's q/k norms get them. Anything else: flattened rows (inner 1)."""
    if x.dim() == 3 and x.stride(-1) == 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return x, x.stride(0), x.stride(1), x.shape[1]
    x2 = _rows(x)
    return x2, x2.stride(0), 0, 1


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    if residual is None:
        x2, stride_x, stride_inner, inner = _strided_rows(x)
    else:
        x2 = _rows(x)
        stride_x, stride_inner, inner = x2.stride(0), 0, 1
    t = x2.numel() // hidden
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((t, hidden), dtype=out_dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    else:
        r2, res_out = out, out  # unused by the kernel
    block = next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    if t > 0:
        _rms_norm_kernel[(t,)](
            x2, r2, weight, out, res_out,
            stride_x, stride_inner, inner, r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **pdl(x2),
        )  # fmt: skip
    return out.view(*x.shape[:-1], hidden), res_out.view(*x.shape[:-1], hidden)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H], weight: [H]
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) in new tensors (inputs are not written)."""
    return _launch(x, residual, weight, eps)
