"""Triton bias add + GELU; must equal `bias_gelu_torch` in gelu.py. Grid: one program per
(row, column block). tanh is written through exp (tanh(u) = 1 - 2 / (exp(2u) + 1)), which
Triton's interpreter also runs; its error is an ulp of 1, which is what 1 + tanh keeps."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # globals read in @jit must be constexpr
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _bias_gelu_kernel(
    x_ptr,  # [T, N]
    b_ptr,  # [N] (only read when HAS_BIAS)
    out_ptr,  # [T, N]
    stride_x, stride_out,
    n,
    HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    s = x.to(tl.float32)
    if HAS_BIAS:
        s = (s + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype).to(tl.float32)
    if TANH:
        u = _SQRT_2_OVER_PI * (s + 0.044715 * s * s * s)
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        y = 0.5 * s * (1.0 + t)
    else:
        y = 0.5 * s * (1.0 + tl.math.erf(s * _INV_SQRT_2))
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu_triton(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    # x: [..., N], bias: [N] -> [..., N]
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(n), 1024)
    if t > 0:
        _bias_gelu_kernel[(t, triton.cdiv(n, block))](
            x2, x2 if bias is None else bias, out, x2.stride(0), out.stride(0), n,
            HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
