"""Triton SiLU-and-mul and GELU(tanh)-and-mul; must equal `silu_and_mul_torch` and
`gelu_tanh_and_mul_torch` in activation.py. Grid: one program per (row, column block). Like
torch, the activation's result is rounded to the input dtype before the product."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [T, 2 * d]
    out_ptr,  # [T, d]
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,  # False: silu(gate) * up; True: gelu_tanh(gate) * up
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
    tl.store(out_ptr + row * stride_out + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * d] -> [..., d]
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    # x: [..., 2 * d] -> [..., d]
    return _act_and_mul(x, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(d), 1024)
    if t > 0:
        grid = (t, triton.cdiv(d, block))
        _act_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, GELU_TANH=gelu_tanh,
                                  num_warps=4, **pdl(x2))  # fmt: skip
    return out.view(*x.shape[:-1], d)
