"""Triton SiLU-and-mul and GELU(tanh)-and-mul; must equal `silu_and_mul_torch` and
`gelu_tanh_and_mul_torch` in activation.py. Grid: one program per (row, column block). Like
torch, the activation's result is rounded to the input dtype before the product.

`act_and_mul_fp8_triton`: the same product quantized per token to e4m3 in the same kernel (one
program per row, the whole row in registers), for a W8A8 down projection (fp8.Fp8Rows): the
values and scales of `per_token_quant_torch` applied to the 16-bit product, without writing that
product or launching the quantization kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl, unit_stride_rows
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [T, 2 * d]
    out_ptr,  # [T, d] x's dtype, or e4m3 (QUANT)
    s_ptr,  # [T] float32 per-token scales (QUANT)
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,  # False: silu(gate) * up; True: gelu_tanh(gate) * up
    QUANT: tl.constexpr = False,  # per-token e4m3 (one program a row: BLOCK >= d)
    FP8_MAX_: tl.constexpr = 448.0,
    MIN_SCALE_: tl.constexpr = 0.0,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
):
    pdl_release(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:
        # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(u) = 1 - 2 / (e^2u + 1)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))).to(gate.dtype).to(tl.float32)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = (act * up.to(tl.float32)).to(gate.dtype)
    if QUANT:  # per_token_quant's arithmetic on the rounded product (masked columns are 0)
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=0) / FP8_MAX_, MIN_SCALE_)
        q = tl.clamp(yf / scale, -FP8_MAX_, FP8_MAX_)
        tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * d] -> [..., d]
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * d] -> [..., d]
    return _act_and_mul(x, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = unit_stride_rows(x)
    t = x2.shape[0]
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(d), 1024)
    if t > 0:
        grid = (t, triton.cdiv(d, block))
        _act_and_mul_kernel[grid](x2, out, out, x2.stride(0), out.stride(0), d, BLOCK=block, GELU_TANH=gelu_tanh,
                                  num_warps=4, **pdl(x2))  # fmt: skip
    return out.view(*x.shape[:-1], d)


# the widest row act_and_mul_fp8_triton holds in one program (32 warps, 32 values a thread)
FP8_MAX_D = 32768


def act_and_mul_fp8_triton(x: torch.Tensor, gelu_tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2 * d] 16-bit, d <= FP8_MAX_D -> (e4m3 [T, d], scale [T, 1] float32): equal to
    `per_token_quant_triton(silu_and_mul_triton(x))` (or GELU's), in one kernel."""
    from pagedllm.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

    d = x.shape[-1] // 2
    if d > FP8_MAX_D or x.dim() != 2:
        raise ValueError(f"act_and_mul_fp8_triton takes [T, 2 * d] rows with d <= {FP8_MAX_D}, got {tuple(x.shape)}")
    x2 = unit_stride_rows(x)
    t = x2.shape[0]
    q = torch.empty((t, d), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    block = next_power_of_2(d)
    if t > 0:
        _act_and_mul_kernel[(t, 1)](x2, q, s, x2.stride(0), q.stride(0), d, BLOCK=block, GELU_TANH=gelu_tanh,
                                    QUANT=True, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE,
                                    num_warps=min(max(block // 1024, 4), 32), **pdl(x2))  # fmt: skip
    return q, s
