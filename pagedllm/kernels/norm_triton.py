"""Triton RMSNorm and fused residual-add + RMSNorm; they must equal `rms_norm_torch` and
`fused_add_rms_norm_torch` in norm.py. One program per row; the row lives in registers. Rows
need not be flattenable: q/k heads [T, H, D] sliced from a fused qkv projection are read in
place (a token stride and a head stride), not copied first.

Numerics follow the reference step by step: the residual sum is rounded to the input dtype, the
norm is computed in float32 and rounded to the input dtype, then multiplied by the weight (the
product of two 16-bit floats is exact in float32, so one final rounding matches torch's).

`rms_norm_fp8_triton`: the same normed rows quantized per token to e4m3 in the same kernel, for a
W8A8 product (fp8.Fp8Rows): `per_token_quant_torch`'s arithmetic on the rounded 16-bit output,
which is not written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl, unit_stride_rows
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
    s_ptr=None,  # [T] float32 per-token scales (QUANT)
    QUANT: tl.constexpr = False,  # out e4m3, quantized per token (the weight has x's dtype)
    FP8_MAX_: tl.constexpr = 448.0,
    MIN_SCALE_: tl.constexpr = 0.0,
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
    if QUANT:  # per_token_quant's arithmetic on the output rounded to x's dtype (masked columns are 0)
        o = (w * y).to(in_dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(o), axis=0) / FP8_MAX_, MIN_SCALE_)
        q = tl.clamp(o / scale, -FP8_MAX_, FP8_MAX_)
        tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _strided_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x, outer row stride, inner row stride, rows per outer step) for x [..., R, H] whose
    rows cannot be flattened without a copy but whose last two dims can be walked in place:
    q or k heads [T, Hq, D] split from a fused qkv projection (a stride per token and one per
    head), as Qwen3's q/k norms get them. Anything else: flattened rows (inner 1)."""
    if x.dim() == 3 and x.stride(-1) == 1 and x.stride(0) != x.shape[1] * x.stride(1):
        return x, x.stride(0), x.stride(1), x.shape[1]
    x2 = unit_stride_rows(x)
    return x2, x2.stride(0), 0, 1


def _launch(x, residual, weight, eps, fp8=False):
    hidden = x.shape[-1]
    if residual is None:
        x2, stride_x, stride_inner, inner = _strided_rows(x)
    else:
        x2 = unit_stride_rows(x)
        stride_x, stride_inner, inner = x2.stride(0), 0, 1
    t = x2.numel() // hidden
    out_dtype = torch.float8_e4m3fn if fp8 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((t, hidden), dtype=out_dtype, device=x.device)
    quant = {}
    if fp8:
        from pagedllm.kernels.fp8 import FP8_MAX, MIN_SCALE

        scale = torch.empty((t, 1), dtype=torch.float32, device=x.device)
        quant = dict(s_ptr=scale, QUANT=True, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE)
    if residual is not None:
        r2 = unit_stride_rows(residual)
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
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **quant, **pdl(x2),
        )  # fmt: skip
    if fp8:
        return (out, quant["s_ptr"]), res_out
    return out.view(*x.shape[:-1], hidden), res_out.view(*x.shape[:-1], hidden)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H], weight: [H]
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) in new tensors (inputs are not written)."""
    return _launch(x, residual, weight, eps)


def rms_norm_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """x [T, H] (+ residual [T, H]), weight [H] of x's dtype -> ((e4m3 [T, H], scale [T, 1] float32),
    x + residual or None): `per_token_quant_triton` of `rms_norm_triton(x)` (or of the fused add's
    norm), in one kernel that writes no 16-bit norm."""
    if x.dim() != 2 or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_fp8_triton takes [T, H] rows and a weight of their dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {weight.dtype}")
    rows, res = _launch(x, residual, weight, eps, fp8=True)
    return rows, (res if residual is not None else None)
