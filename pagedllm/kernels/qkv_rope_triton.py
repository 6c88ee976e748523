"""Triton: q/k RMSNorm + rotary + store-KV in one kernel, reading q, k, v once from the qkv
projection's output; must equal `qkv_norm_rope_store_torch` in qkv_rope.py (the unfused chain
rms_norm -> apply_rotary -> store_kv), to bf16 tolerance: the head's sum of squares is added in
another order, every rounding is the unfused kernels' own.

Grid: (tokens, q head blocks + kv head blocks). A q program normalizes and rotates BLOCK_H
heads of q and writes them to q_out; a kv program does the same to BLOCK_H heads of k and
writes them, and the matching v heads, to the token's cache slot (none for slot -1). Each head
is held as its two rotary halves, so the rotation needs no shuffle:

    head [D] = | x1 (D/2) | x2 (D/2) |   -> | x1 cos1 - x2 sin1 | x2 cos2 + x1 sin2 |

Numerics as the unfused kernels: the norm in float32, rounded to the activation dtype before
and after the weight multiply; cos/sin rounded to the activation dtype; the rotation in float32
rounded once; an FP8 cache takes the rounded k (less its offset, in float32, where the layer has
one: qkv_rope.py) and v, times 1 / scale, saturated."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.attention import finite_v, fp8_max, v_layout_ok, v_store_max


@triton.jit
def _rounded_row(row_ptr, cols, col_mask, act: tl.constexpr):
    """Columns `cols` of a float32 table's row, rounded to the activation dtype (read through the
    L2, .cg: it may come before the PDL wait)."""
    return tl.load(row_ptr + cols, mask=col_mask, other=0.0, cache_modifier=".cg").to(act).to(tl.float32)


@triton.jit
def _norm_rotate(
    head_ptr, heads, head_mask, cols, col_mask, cos1, cos2, sin1, sin2, w_ptr, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads `heads` [BLOCK_H] at head_ptr (head stride HEAD_DIM) -> their rotated halves
    ([BLOCK_H, BLOCK_HALF] each, in the activation dtype)."""
    mask = head_mask[:, None] & col_mask[None, :]
    src = head_ptr + heads[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        a = _weighted(a, r, w1, x1.dtype)
        b = _weighted(b, r, w2, x1.dtype)
    o1 = (a * cos1[None, :] - b * sin1[None, :]).to(x1.dtype)
    o2 = (b * cos2[None, :] + a * sin2[None, :]).to(x1.dtype)
    return o1, o2


@triton.jit
def _weighted(a, r, w, act: tl.constexpr):
    """RMSNorm's product as the unfused kernel rounds it: x * r to the activation dtype, times
    the weight, to the activation dtype again (held in float32)."""
    return (w * (a * r).to(act).to(tl.float32)).to(act).to(tl.float32)


@triton.jit
def _norm_rope_heads(
    row_ptr, heads, head_mask, dims, dim_mask, cos, sin, w_ptr, eps, stride_h,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """`_norm_rotate` on whole heads: heads `heads` [H] at row_ptr + head * stride_h, normed
    (HAS_NORM) and rotated -> [H, BLOCK_D] in the activation dtype, for a kernel that holds a
    head as one row (the decode kernel's q). Each column is paired with its rotary partner d +- D/2,
    loaded a second time, and `cos` / `sin` are the position's whole rows ([BLOCK_D], rounded to
    the activation dtype): out[d] = x[d] cos[d] -+ x[partner] sin[d]. The same roundings as
    `_norm_rotate`; the head's sum of squares is added in another order."""
    half: tl.constexpr = HEAD_DIM // 2
    first = dims < half
    partner = tl.where(first, dims + half, dims - half)
    mask = head_mask[:, None] & dim_mask[None, :]
    src = row_ptr + heads[:, None] * stride_h
    x = tl.load(src + dims[None, :], mask=mask, other=0.0)
    a = x.to(tl.float32)
    b = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt(tl.sum(a * a, axis=1) / HEAD_DIM + eps)[:, None]
        a = _weighted(a, r, tl.load(w_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :], x.dtype)
        b = _weighted(b, r, tl.load(w_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)[None, :], x.dtype)
    return (a * cos[None, :] + b * tl.where(first, -sin, sin)[None, :]).to(x.dtype)


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) * D], rows contiguous
    pos_ptr,  # [T] int
    cos_ptr, sin_ptr,  # [max_pos, D] float32
    qw_ptr, kw_ptr,  # [D] q_norm / k_norm weights (read when HAS_NORM)
    q_out_ptr,  # [T, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [N, bs, Hkv, D] (V strided: FP8 V blocks are stored [Hkv, D, bs])
    slot_ptr,  # [T] int64, -1 = skip
    stride_qkv, stride_qot, stride_qoh, stride_cos, stride_sin,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_q_heads, num_kv_heads, eps, inv_k_scale, inv_v_scale,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    HAS_NORM: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: an FP8 cache, values scaled and saturated to +-FP8_MAX
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
    V_MAX: tl.constexpr = 0.0,  # > 0: a 16-bit V cache read key-major (attention.v_store_max)
    koff_ptr=None,  # [Hkv, D] float32: K stored less this offset (HAS_K_OFFSET)
    HAS_K_OFFSET: tl.constexpr = False,
):  # fmt: skip
    pdl_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    row = qkv_ptr + t * stride_qkv
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    # cos/sin rounded to the activation dtype, as the reference's `cos_cache[positions].to(q.dtype)`.
    # The step's inputs (positions, slots) and the tables come before the PDL wait, through the
    # L2 (.cg; pdl_triton.py, rule 1): only qkv is the kernel before's
    pos = tl.load(pos_ptr + t, cache_modifier=".cg").to(tl.int64)
    slot = tl.load(slot_ptr + t, cache_modifier=".cg").to(tl.int64)
    act = qkv_ptr.dtype.element_ty
    cos1 = _rounded_row(cos_ptr + pos * stride_cos, cols, col_mask, act)
    cos2 = _rounded_row(cos_ptr + pos * stride_cos + HALF, cols, col_mask, act)
    sin1 = _rounded_row(sin_ptr + pos * stride_sin, cols, col_mask, act)
    sin2 = _rounded_row(sin_ptr + pos * stride_sin + HALF, cols, col_mask, act)
    pdl_wait(PDL)
    if hb < num_q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_q_heads
        o1, o2 = _norm_rotate(row, heads, head_mask, cols, col_mask, cos1, cos2, sin1, sin2, qw_ptr, eps,
                              HEAD_DIM, HALF, HAS_NORM)  # fmt: skip
        dst = q_out_ptr + t * stride_qot + heads[:, None] * stride_qoh + cols[None, :]
        mask = head_mask[:, None] & col_mask[None, :]
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    elif slot >= 0:
        heads = (hb - num_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_kv_heads
        mask = head_mask[:, None] & col_mask[None, :]
        k_row = row + num_q_heads * HEAD_DIM
        k1, k2 = _norm_rotate(k_row, heads, head_mask, cols, col_mask, cos1, cos2, sin1, sin2, kw_ptr, eps,
                              HEAD_DIM, HALF, HAS_NORM)  # fmt: skip
        if HAS_K_OFFSET:  # the rounded k less the offset, in float32 (scaled below)
            c = koff_ptr + heads[:, None] * HEAD_DIM + cols[None, :]
            k1 = k1.to(tl.float32) - tl.load(c, mask=mask, other=0.0)
            k2 = k2.to(tl.float32) - tl.load(c + HALF, mask=mask, other=0.0)
        v_src = k_row + num_kv_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + cols[None, :]
        v1 = tl.load(v_src, mask=mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + cols[None, :]
        vc = (v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
              + cols[None, :] * stride_vcd)
        if FP8_MAX > 0:
            k1 = tl.clamp(k1.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
            k2 = tl.clamp(k2.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
            # a NaN is stored as 0: the attention kernels read whole FP8 V blocks (v_transposed)
            v1 = tl.clamp(finite_v(v1) * inv_v_scale, -FP8_MAX, FP8_MAX)
            v2 = tl.clamp(finite_v(v2) * inv_v_scale, -FP8_MAX, FP8_MAX)
        elif V_MAX > 0:
            v1, v2 = tl.clamp(finite_v(v1), -V_MAX, V_MAX), tl.clamp(finite_v(v2), -V_MAX, V_MAX)
        cdt = k_cache_ptr.dtype.element_ty
        tl.store(kc, k1.to(cdt), mask=mask)
        tl.store(kc + HALF, k2.to(cdt), mask=mask)
        tl.store(vc, v1.to(cdt), mask=mask)
        tl.store(vc + HALF * stride_vcd, v2.to(cdt), mask=mask)


def default_block_h(num_tokens: int, num_heads: int) -> int:
    """Heads per program: few for few tokens (a batch-1 step spreads its 48 heads over 12
    programs), more for many (fewer, fuller programs)."""
    return min(4 if num_tokens <= 64 else 8, next_power_of_2(num_heads))


def qkv_norm_rope_store_triton(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int
    cos_cache: torch.Tensor,  # [max_pos, D] float32
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,  # [D]
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_h: int | None = None,  # heads per program (default_block_h)
    k_offset: torch.Tensor | None = None,  # [Hkv, D] float32: K stored less it (qkv_rope.py)
) -> torch.Tensor:  # q [T, Hq, D]
    t = qkv.shape[0]
    d = head_dim
    assert d % 2 == 0 and cos_cache.shape[-1] == d, "rotary needs an even head_dim equal to the cache width"
    assert qkv.shape[-1] == (num_heads + 2 * num_kv_heads) * d, "qkv width is not (Hq + 2 Hkv) * head_dim"
    assert k_cache.stride(-1) == 1 and v_layout_ok(v_cache), "the cache's head_dim must be contiguous"
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos_cache = cos_cache if cos_cache.stride(-1) == 1 else cos_cache.contiguous()
    sin_cache = sin_cache if sin_cache.stride(-1) == 1 else sin_cache.contiguous()
    q_out = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q_out
    has_norm = q_norm_weight is not None
    if has_norm:
        assert k_norm_weight is not None and q_norm_weight.shape[-1] == d == k_norm_weight.shape[-1]
    assert k_offset is None or (k_offset.dtype == torch.float32 and k_offset.shape == (num_kv_heads, d)
                                and k_offset.is_contiguous())
    qw = q_norm_weight if has_norm else cos_cache  # unused pointers without the norm
    kw = k_norm_weight if has_norm else cos_cache
    half = d // 2
    bh = block_h or default_block_h(t, max(num_heads, num_kv_heads))
    grid = (t, triton.cdiv(num_heads, bh) + triton.cdiv(num_kv_heads, bh))
    _qkv_rope_store_kernel[grid](
        qkv, positions, cos_cache, sin_cache, qw, kw, q_out, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q_out.stride(0), q_out.stride(1), cos_cache.stride(0), sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        num_heads, num_kv_heads, eps, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=d, HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_H=bh, BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm, FP8_MAX=fp8_max(k_cache.dtype), V_MAX=v_store_max(v_cache),
        num_warps=max(1, min(8, bh * next_power_of_2(d) // 256)), **pdl(qkv),
        **({} if k_offset is None else dict(koff_ptr=k_offset, HAS_K_OFFSET=True)),
    )  # fmt: skip
    return q_out
