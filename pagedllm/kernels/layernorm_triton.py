"""Triton LayerNorm and fused residual-add + LayerNorm; they must equal `layer_norm_torch` and
`fused_add_layer_norm_torch` in layernorm.py. One program per row; the row lives in registers.

Numerics follow the reference: the residual sum is rounded to the input dtype (and written out),
mean and variance (two passes over the row in registers, not E[x^2] - E[x]^2) are float32, and
the normalised row times the weight plus the bias is rounded once to the output dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, unit_stride_rows


@triton.jit
def _layer_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] residual in (only read when HAS_RESIDUAL)
    w_ptr,  # [H]
    b_ptr,  # [H] (only read when HAS_BIAS)
    out_ptr,  # [T, H] normed out
    res_out_ptr,  # [T, H] x + residual out (only written when HAS_RESIDUAL)
    stride_x, stride_res, stride_out, stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=0) / hidden
    xc = tl.where(mask, xf - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / hidden
    y = xc * tl.rsqrt(var + eps) * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, bias, eps):
    hidden = x.shape[-1]
    x2 = unit_stride_rows(x)
    t = x2.shape[0]
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = unit_stride_rows(residual)
        res_out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out  # unused by the kernel
    block = next_power_of_2(hidden)
    if t > 0:
        _layer_norm_kernel[(t,)](
            x2, r2, weight, weight if bias is None else bias, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK=block,
            num_warps=min(max(block // 512, 1), 16),
        )  # fmt: skip
    return out.view(*x.shape[:-1], hidden), res_out.view(*x.shape[:-1], hidden)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # x: [..., H], weight / bias: [H]
    return _launch(x, None, weight, bias, eps)[0]


def fused_add_layer_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual) in new tensors (inputs are not written)."""
    return _launch(x, residual, weight, bias, eps)
