"""Triton rotary embedding (rotate-half layout); must equal `apply_rotary_torch` in rotary.py.
One program per token rotates all its q heads and k heads; q and k are not written, the
results are new contiguous tensors.

    head [D] = | x1 (D/2) | x2 (D/2) |
    out      = | x1*cos1 - x2*sin1 | x2*cos2 + x1*sin2 |   cos/sin = cache[position], split alike

As in the reference, cos and sin are rounded to the activation dtype before use."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_x_head, stride_out_head, num_heads, cos1, cos2, sin1, sin2,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    src = x_ptr + heads[:, None] * stride_x_head + cols[None, :]
    dst = out_ptr + heads[:, None] * stride_out_head + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(dst, (a * cos1[None, :] - b * sin1[None, :]).to(x1.dtype), mask=mask)
    tl.store(dst + HALF, (b * cos2[None, :] + a * sin2[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,  # [T] int64
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    cos_ptr,  # [max_pos, D] float32
    sin_ptr,  # [max_pos, D] float32
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cos, stride_sin,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    # Round to the activation dtype like the reference's `cos_cache[positions].to(q.dtype)`.
    act = q_ptr.dtype.element_ty
    cos1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=cmask, other=0.0).to(act).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + cols, mask=cmask, other=0.0).to(act).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=cmask, other=0.0).to(act).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + cols, mask=cmask, other=0.0).to(act).to(tl.float32)
    _rotate_heads(
        q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads,
        cos1, cos2, sin1, sin2, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh, num_kv_heads,
        cos1, cos2, sin1, sin2, HALF, BLOCK_HKV, BLOCK_HALF,
    )  # fmt: skip


def apply_rotary_triton(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [max_pos, D] float32
    sin_cache: torch.Tensor,  # [max_pos, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert d % 2 == 0 and cos_cache.shape[-1] == d, "rotary needs an even head_dim equal to the cache width"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cos_cache = cos_cache if cos_cache.stride(-1) == 1 else cos_cache.contiguous()
    sin_cache = sin_cache if sin_cache.stride(-1) == 1 else sin_cache.contiguous()
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = d // 2
    block_hq, block_hkv = next_power_of_2(hq), next_power_of_2(hkv)
    num_warps = 4 if block_hq * next_power_of_2(half) <= 2048 else 8
    _rotary_kernel[(t,)](
        positions, q, k, cos_cache, sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        hq, hkv,
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=next_power_of_2(half),
        num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out
