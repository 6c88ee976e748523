"""The attention block's front in one launch for a decode batch of 1-16 tokens: the qkv projection
(the swap-AB product of swap_gemm_triton.py, optionally normalizing the residual stream it reads)
with the q/k RMSNorm + rotary + store-KV of qkv_rope_triton.py in its epilogue. Must equal
`qkv_gemm_rope_torch` (the product as small_m_linear_torch computes it, then
qkv_norm_rope_store_torch), to bf16 tolerance.

Each program's weight tile is one head (BLOCK_N = head_dim), so the program that finishes a tile
holds the whole head of every token: with split-K the last of the tile's programs (counting on a
persistent counter, kernels/counters.py) sums the workspace, as swap_gemm_triton's reduce "last"
does. That program stores the head's qkv values (the plain product's output, rounded), then reads
them back through the CTA (a barrier between) as the fused rope kernel reads its input, and per
token:

    q head  -> [q_norm] -> rotary -> q_out[t, h]
    k head  -> [k_norm] -> rotary -> k_cache[slot[t]]     (slot -1: nothing stored)
    v head  -----------------------> v_cache[slot[t]]

Positions, slots and the cos/sin rows are read after the product (they are the step's inputs,
written before its first kernel). No rope/store kernel follows the product, so a decode layer has
one kernel fewer in its PDL chain (LlamaDecoderLayer.forward_stream, PAGEDLLM_FUSED_QKV_GEMM=1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl
from pagedllm.kernels.attention import fp8_max, v_layout_ok, v_store_max
from pagedllm.kernels.counters import counters
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.qkv_rope_triton import _norm_rotate, _rounded_row, _store_k, _store_v
from pagedllm.kernels.swap_gemm_triton import (
    SWAP_BLOCK_M,
    SwapConfig,
    _epilogue,
    _split,
    _sum_splits,
    _swap_product,
    norm_residual_args,
)

# the most programs the split-K choice aims for (small_m's sweep: 64-128 programs streamed best)
_TARGET_PROGRAMS = 128
_MAX_SPLIT_K = 8


@triton.jit
def _rope_store_token(row, t, head, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr,
                      v_cache_ptr, stride_cos, stride_sin, stride_qot, stride_qoh, stride_kcb, stride_kcs, stride_kch,
                      stride_vcb, stride_vcs, stride_vch, stride_vcd, num_q_heads, num_kv_heads, eps, inv_k_scale,
                      inv_v_scale, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, FP8_MAX: tl.constexpr,
                      V_MAX: tl.constexpr):  # fmt: skip
    """Token t's head `head` of the qkv row at `row` (q, k or v by its index) normed, rotated and
    stored as _qkv_rope_store_kernel stores it."""
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    one = tl.arange(0, 1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if head < num_q_heads + num_kv_heads:  # q or k: normed and rotated
        pos = tl.load(pos_ptr + t).to(tl.int64)
        act = row.dtype.element_ty
        cos1 = _rounded_row(cos_ptr + pos * stride_cos, cols, col_mask, act)
        cos2 = _rounded_row(cos_ptr + pos * stride_cos + HALF, cols, col_mask, act)
        sin1 = _rounded_row(sin_ptr + pos * stride_sin, cols, col_mask, act)
        sin2 = _rounded_row(sin_ptr + pos * stride_sin + HALF, cols, col_mask, act)
        if head < num_q_heads:
            heads = head + one
            o1, o2 = _norm_rotate(row, heads, heads < num_q_heads, cols, col_mask, cos1, cos2, sin1, sin2, qw_ptr,
                                  eps, HEAD_DIM, HALF, HAS_NORM)  # fmt: skip
            dst = q_out_ptr + t * stride_qot + heads[:, None] * stride_qoh + cols[None, :]
            mask = (heads >= 0)[:, None] & col_mask[None, :]
            tl.store(dst, o1, mask=mask)
            tl.store(dst + HALF, o2, mask=mask)
        elif slot >= 0:
            kv = head - num_q_heads + one
            k1, k2 = _norm_rotate(row + num_q_heads * HEAD_DIM, kv, kv >= 0, cols, col_mask, cos1, cos2, sin1, sin2,
                                  kw_ptr, eps, HEAD_DIM, HALF, HAS_NORM)  # fmt: skip
            _store_k(k1, k2, k_cache_ptr, slot, kv, cols, (kv >= 0)[:, None] & col_mask[None, :], stride_kcb,
                     stride_kcs, stride_kch, inv_k_scale, HALF, BLOCK_SIZE, FP8_MAX)  # fmt: skip
    elif slot >= 0:  # v: stored as it is
        kv = head - num_q_heads - num_kv_heads + one
        mask = (kv >= 0)[:, None] & col_mask[None, :]
        src = row + (num_q_heads + num_kv_heads) * HEAD_DIM + kv[:, None] * HEAD_DIM + cols[None, :]
        v1 = tl.load(src, mask=mask, other=0.0)
        v2 = tl.load(src + HALF, mask=mask, other=0.0)
        _store_v(v1, v2, v_cache_ptr, slot, kv, cols, mask, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                 inv_v_scale, HALF, BLOCK_SIZE, FP8_MAX, V_MAX)  # fmt: skip


@triton.jit
def _swap_qkv_rope_kernel(
    x_ptr,  # [M, K] activations (NORM: the residual stream)
    w_ptr,  # [N, K] the qkv weight, N = (Hq + 2 Hkv) * HEAD_DIM
    b_ptr,  # [N] bias (HAS_BIAS)
    nw_ptr,  # [K] the input RMSNorm's weight (NORM)
    qkv_ptr,  # [M, N] the product (written; read back by the epilogue)
    ws_ptr,  # [SPLIT_K, M, N] float32 workspace (SPLIT_K > 1)
    count_ptr,  # [N / HEAD_DIM] int32 counters, zero between calls (SPLIT_K > 1)
    pos_ptr, slot_ptr,  # [M] positions, cache slots (-1: not stored)
    cos_ptr, sin_ptr,  # [max_pos, HEAD_DIM] float32
    qw_ptr, kw_ptr,  # [HEAD_DIM] q_norm / k_norm weights (HAS_QK_NORM)
    q_out_ptr,  # [M, Hq, HEAD_DIM]
    k_cache_ptr, v_cache_ptr,  # [N, bs, Hkv, D] (V strided as qkv_rope_triton's)
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_qkv, stride_cos, stride_sin, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_q_heads, num_kv_heads, eps, qk_eps, inv_k_scale, inv_v_scale,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, BLOCK_KN: tl.constexpr, NORM_ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # also the weight tile's rows: a program's tile is one head
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_QK_NORM: tl.constexpr,
    FP8_MAX: tl.constexpr, V_MAX: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
):  # fmt: skip
    pdl_release(PDL)
    head = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    n_mask = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    out_mask = n_mask[:, None] & m_mask[None, :]
    pdl_wait(PDL)
    acc = _swap_product(x_ptr, w_ptr, w_ptr, nw_ptr, rn.to(tl.int64), n_mask, rm, m_mask, pid_k * K_SPLIT, M, K,
                        K_SPLIT, stride_xm, stride_wn, 0, eps, False, 0, EVEN_K, HEAD_DIM, BLOCK_K, "weight", 0.0,
                        NORM, BLOCK_KN, NORM_ROWS)  # fmt: skip
    last = True
    if SPLIT_K > 1:
        tl.store(ws_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None], acc, mask=out_mask)
        # the stores before the barrier, the barrier before the count (swap_gemm_triton's protocol)
        tl.debug_barrier()
        last = tl.atomic_add(count_ptr + head, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if last:
        if SPLIT_K > 1:
            acc = _sum_splits(ws_ptr, rm, rn, out_mask, M, N, SPLIT_K)
        acc = _epilogue(acc, w_ptr, b_ptr, rn, n_mask, n_mask, 0, False, 0, HAS_BIAS)
        tl.store(qkv_ptr + rm[None, :] * stride_qkv + rn[:, None], acc.to(qkv_ptr.dtype.element_ty), mask=out_mask)
        tl.debug_barrier()  # the head's values, stored by all the threads, read back in the rope's layout
        for t in range(M):
            _rope_store_token(qkv_ptr + t * stride_qkv, t, head, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                              q_out_ptr, k_cache_ptr, v_cache_ptr, stride_cos, stride_sin, stride_qot, stride_qoh,
                              stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                              num_q_heads, num_kv_heads, qk_eps, inv_k_scale, inv_v_scale, HEAD_DIM, HALF,
                              BLOCK_HALF, BLOCK_SIZE, HAS_QK_NORM, FP8_MAX, V_MAX)  # fmt: skip
        if SPLIT_K > 1:
            tl.store(count_ptr + head, 0)  # zero again for the next call (or graph replay)


def qkv_gemm_config(m: int, n: int, k: int, head_dim: int) -> SwapConfig:
    """Head-wide weight tiles, split-K by powers of two while the programs stay within
    _TARGET_PROGRAMS and each split keeps two 128-wide K steps (small_m.heuristic_config's rule
    with the tile fixed to a head); 4 stages unsplit, else 3."""
    tiles = -(-n // head_dim)
    split_k = 1
    while 2 * split_k * tiles <= _TARGET_PROGRAMS and split_k < _MAX_SPLIT_K and k >= 2 * 128 * (2 * split_k):
        split_k *= 2
    if split_k == 1:
        return SwapConfig(head_dim, 256 if head_dim <= 64 else 128, 1, num_warps=4, num_stages=4)
    return SwapConfig(head_dim, 128, split_k, num_warps=4, num_stages=3)


def qkv_gemm_rope_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None,  # (weight [K], eps): x is the residual stream
    positions: torch.Tensor,  # [M] int
    cos_cache: torch.Tensor,  # [max_pos, D] float32
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [M] int64, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    qk_eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    config: SwapConfig | None = None,  # block_n must be head_dim (qkv_gemm_config's by default)
) -> torch.Tensor:  # q [M, Hq, D], normed and rotated; k and v stored
    m, k = x.shape
    n = weight.shape[0]
    d = head_dim
    assert n == (num_heads + 2 * num_kv_heads) * d and weight.shape[1] == k
    assert k_cache.stride(-1) == 1 and v_layout_ok(v_cache), "the cache's head_dim must be contiguous"
    assert cos_cache.shape[-1] == d and cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or qkv_gemm_config(m, n, k, d)
    assert cfg.block_n == d, "a program's weight tile must be one head"
    k_split, split_k = _split(k, cfg)
    qkv = torch.empty((m, n), dtype=x.dtype, device=x.device)
    q_out = torch.empty((m, num_heads, d), dtype=x.dtype, device=x.device)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else qkv
    count = counters(x.device, n // d) if split_k > 1 else qkv
    has_qk_norm = q_norm_weight is not None
    nw = norm_residual_args(x, norm, None)[0]
    qw = q_norm_weight if has_qk_norm else cos_cache  # unused pointers without the q/k norm
    kw = k_norm_weight if has_qk_norm else cos_cache
    _swap_qkv_rope_kernel[(n // d, split_k)](
        x, weight, bias if bias is not None else weight, nw, qkv, ws, count, positions, slot_mapping,
        cos_cache, sin_cache, qw, kw, q_out, k_cache, v_cache, m, n, k, k_split,
        x.stride(0), weight.stride(0), qkv.stride(0), cos_cache.stride(0), sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        num_heads, num_kv_heads, norm[1] if norm is not None else 0.0, qk_eps, 1.0 / k_scale, 1.0 / v_scale,
        HAS_BIAS=bias is not None, NORM=norm is not None, BLOCK_KN=next_power_of_2(k) if norm is not None else 1,
        NORM_ROWS=next_power_of_2(m) if norm is not None else 1,
        EVEN_K=k_split * split_k == k, SPLIT_K=split_k, BLOCK_M=SWAP_BLOCK_M, BLOCK_K=cfg.block_k, HEAD_DIM=d,
        HALF=d // 2, BLOCK_HALF=next_power_of_2(d // 2), BLOCK_SIZE=k_cache.shape[1], HAS_QK_NORM=has_qk_norm,
        FP8_MAX=fp8_max(k_cache.dtype), V_MAX=v_store_max(v_cache), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl(x),
    )  # fmt: skip
    return q_out


def qkv_gemm_rope_torch(x, weight, bias, norm, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
                        num_heads, num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None, qk_eps=1e-6,
                        k_scale=1.0, v_scale=1.0) -> torch.Tensor:  # fmt: skip
    """The reference: the product as small_m_linear_torch computes it (norm first), then the
    unfused q/k norm + rotary + store (qkv_norm_rope_store_torch)."""
    from pagedllm.kernels.qkv_rope import qkv_norm_rope_store_torch
    from pagedllm.kernels.small_m import small_m_linear_torch

    qkv = small_m_linear_torch(x, weight, bias, norm=norm)
    return qkv_norm_rope_store_torch(qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, num_heads,
                                     num_kv_heads, head_dim, q_norm_weight, k_norm_weight, qk_eps, k_scale, v_scale)
