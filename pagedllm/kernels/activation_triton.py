"""Triton SiLU-and-mul; must equal `silu_and_mul_torch` in activation.py. Grid: one program per
(row, column block). Like torch, silu's result is rounded to the input dtype before the product."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * d]
    out_ptr,  # [T, d]
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * d] -> [..., d]
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(d), 1024)
    if t > 0:
        grid = (t, triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], d)
