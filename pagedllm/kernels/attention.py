"""Triton kernels of the paged-attention path; each must equal its torch reference in
`pagedllm/attention/torch_backend.py` (`store_kv_torch`, `paged_attention_torch`).

- `store_kv_triton`: writes each token's new K/V into its cache slot (slot -1: skipped).
- `prefill_attention_triton`: varlen FlashAttention over the paged cache for prefill chunks.
- `decode_attention_triton` (attention_decode.py): one query token per request, split-K along
  the context, then a reduce kernel that merges the partial softmaxes.

Both attention kernels read every key and value from the cache, so K/V must be stored first.
They never copy to the host: sizes come from the caller (the `*_cpu` lists of ForwardBatch) and
the per-request lengths are read on the device, so a pure-decode step can be captured in a CUDA
graph (its grid depends only on the batch size and an upper bound of the sequence length).

Prefill chunk of request r, with a cached prefix (chunked prefill or a prefix-cache hit):

    context  |<------ ctx = seq_len - query_len ------>|<--- query_len new tokens --->|
    query i (at position ctx + i) sees keys 0 .. ctx + i

    a query block of BLOCK_M rows starting at row m0 walks the keys in tiles of BLOCK_N:
    keys [0, ctx + m0)             visible to every row: no mask
    keys [ctx + m0, ctx + m0 + BLOCK_M)  the diagonal: causal mask per (row, key)

Keys are gathered through the block table, tile by tile:
    key n  ->  page = block_tables[r, n // block_size], offset = n % block_size

The decode kernel (split-K, one query token per request) lives in attention_decode.py and
shares this module's tile helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------- store KV


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,  # [N, bs, Hkv, D] (strided: FP8 V blocks are stored [Hkv, D, bs])
    slot_ptr,  # [T] int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads,
    inv_k_scale, inv_v_scale,  # 1 / the cache's scales (FP8 caches; 1.0 otherwise)
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: an FP8 cache, values scaled and saturated to +-FP8_MAX
    V_MAX: tl.constexpr = 0.0,  # > 0: a 16-bit V cache read key-major (v_store_max)
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    vc = (v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
          + dims[None, :] * stride_vcd)
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(finite_v(v) * inv_v_scale, -FP8_MAX, FP8_MAX)
    elif V_MAX > 0:
        v = tl.clamp(finite_v(v), -V_MAX, V_MAX)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def finite_v(v):
    """V in float32 with a NaN as 0, as a key-major cache stores it (the callers saturate the
    infinities): the attention kernels read whole key-major V blocks, and p = 0 in a slot past
    the context cancels neither. (Compared in float32: the interpreter compares bf16 bits.)"""
    x = v.to(tl.float32)
    return tl.where(x == x, x, 0.0)


def v_store_max(v_cache: torch.Tensor) -> float:
    """The saturation bound of a 16-bit (or float32) V cache read key-major; 0.0 for any other
    (FP8 caches saturate to fp8_max anyway)."""
    return float(torch.finfo(v_cache.dtype).max) if v_transposed(v_cache) and v_cache.dtype.itemsize > 1 else 0.0


def fp8_max(cache_dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 cache dtype; 0.0 for any other dtype."""
    return float(torch.finfo(cache_dtype).max) if cache_dtype.itemsize == 1 else 0.0


def dot_dtype_fp16(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the attention dots run in fp16: for a 16-bit query over an FP8 cache. Every e4m3
    and e5m2 value is exact in fp16 and the GPU converts FP8 to fp16 in one instruction (to
    bf16 it takes a detour through float32), so this is both exact and cheaper; q itself loses
    nothing that matters (post-norm/rotary queries are far inside fp16's range)."""
    return cache_dtype.itemsize == 1 and q_dtype in (torch.bfloat16, torch.float16)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def v_transposed(v_cache: torch.Tensor) -> bool:
    """Whether a V cache [N, bs, Hkv, D] is the strided view of blocks stored [Hkv, D, bs]
    (attention/backend.py's v_cache_view), which the attention kernels read key-major."""
    return v_cache.stride(-1) != 1


def v_layout_ok(v_cache: torch.Tensor) -> bool:
    """head_dim contiguous, or the key-major blocks of v_cache_view exactly."""
    _, bs, h, d = v_cache.shape
    return v_cache.stride(-1) == 1 or v_cache.stride()[1:] == (1, d * bs, bs)


def store_kv_triton(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    k_scale: float = 1.0,  # FP8 caches: stored = value / scale
    v_scale: float = 1.0,
) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k_cache.stride(-1) == 1 and v_layout_ok(v_cache), "the cache's head_dim must be contiguous"
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    block_h, block_d = next_power_of_2(hkv), next_power_of_2(d)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        hkv, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        FP8_MAX=fp8_max(k_cache.dtype), V_MAX=v_store_max(v_cache),
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip


# ------------------------------------------------------------------------ shared tile helpers


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, keys, key_mask, kv_head, dims, dim_mask,
    stride_b, stride_s, stride_h, BLOCK_SIZE: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Gathers the rows `keys` [BLOCK_N] of one kv head through the block table -> [BLOCK_N, BLOCK_D]
    (CACHE: the loads' cache modifier, ".cg" before a PDL wait, "" elsewhere; no default: Triton 3.6
    passes a called function's defaulted string constexpr on as a plain str, test_triton_calls.py)."""
    page = tl.load(bt_row_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0, cache_modifier=CACHE).to(tl.int64)
    return _kv_rows(cache_ptr, page, keys % BLOCK_SIZE, key_mask, kv_head, dims, dim_mask, stride_b, stride_s,
                    stride_h, CACHE)  # fmt: skip


@triton.jit
def _kv_rows(cache_ptr, page, offset, key_mask, kv_head, dims, dim_mask, stride_b, stride_s, stride_h,
             CACHE: tl.constexpr):  # fmt: skip
    """The rows at (page, offset) [BLOCK_N] of one kv head -> [BLOCK_N, BLOCK_D] (head_dim contiguous)."""
    ptrs = cache_ptr + page[:, None] * stride_b + offset[:, None] * stride_s + kv_head * stride_h + dims[None, :]
    return tl.load(ptrs, mask=key_mask[:, None] & dim_mask[None, :], other=0.0, cache_modifier=CACHE)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k, v, valid, qk_scale,
    DOT_PRECISION: tl.constexpr, soft_cap=0.0, SOFT_CAP: tl.constexpr = False,
):  # fmt: skip
    """One online-softmax step in base 2: q [M, D] against a key tile k, v [N, D].
    `valid` [M, N] masks keys out (every row has at least one valid key over the whole loop).
    SOFT_CAP: scores s -> c * tanh(s / c), with `soft_cap` = c * log2(e) (the scores here are
    in base 2 already, and c tanh(s/c) log2e = c' tanh(s log2e / c'))."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if SOFT_CAP:
        # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (e^2x = inf gives 1, 0 gives -1)
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no valid key yet keeps m = -inf; shift by 0 there to avoid (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, keys, key_mask, kv_end, valid, kv_head, dims, dim_mask,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, soft_cap, SOFT_CAP: tl.constexpr,
    V_T: tl.constexpr = False,
):  # fmt: skip
    """Gathers the K and V rows `keys` [BLOCK_N] of one kv head (key_mask: keys < kv_end) and
    takes the online-softmax step over them (`valid` [M, N]: which (query, key) pairs count).

    V_T: V blocks stored [Hkv, D, bs] (v_transposed). Whole blocks are read, so each block's
    keys are contiguous bytes the loads vectorize (the callers start tiles on block boundaries;
    the hints say so), and the dot's operand has the keys it reduces over contiguous: no
    byte-wise transpose. The slots past kv_end in a block are read too and meet p = 0: they
    hold zeros or what an earlier request stored, never a NaN (FP8 stores write NaN as 0 and
    saturate infinities)."""
    if V_T:
        blk = keys // BLOCK_SIZE
        block_mask = blk * BLOCK_SIZE < kv_end
        page = tl.load(bt_row + blk, mask=block_mask, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        k = _kv_rows(k_cache_ptr, page, offset, key_mask, kv_head, dims, dim_mask, stride_kb, stride_ks, stride_kh, "")
        RUN: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < keys.shape[0] else keys.shape[0]
        offs = page[:, None] * stride_vb + offset[:, None] + kv_head * stride_vh + dims[None, :] * BLOCK_SIZE
        offs = tl.max_contiguous(tl.multiple_of(offs, [RUN, 1]), [RUN, 1])
        v = tl.load(v_cache_ptr + offs, mask=block_mask[:, None] & dim_mask[None, :], other=0.0)
    else:
        k = _load_kv_tile(k_cache_ptr, bt_row, keys, key_mask, kv_head, dims, dim_mask,
                          stride_kb, stride_ks, stride_kh, BLOCK_SIZE, "")  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, bt_row, keys, key_mask, kv_head, dims, dim_mask,
                          stride_vb, stride_vs, stride_vh, BLOCK_SIZE, "")  # fmt: skip
    return _attend_tile(q, acc, m_i, l_i, k, v, valid, qk_scale, DOT_PRECISION, soft_cap, SOFT_CAP)


def window_cap_args(sliding_window: int | None, logits_soft_cap: float | None) -> tuple[tuple[int, float], dict]:
    """The attention kernels' runtime (window, soft cap * log2(e)) and their SLIDING / SOFT_CAP
    switches (an unset option compiles its code out)."""
    runtime = (int(sliding_window or 0), float(logits_soft_cap or 0.0) * _LOG2E)
    return runtime, {"SLIDING": sliding_window is not None, "SOFT_CAP": logits_soft_cap is not None}


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------- prefill


# first_req (the index of the first prefill request, i.e. the number of decodes before it) takes
# any value: not specialized (Triton would compile other variants for 1 and multiples of 16)
@triton.jit(do_not_specialize=["first_req"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,  # [N, bs, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B+1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    qk_scale,  # softmax scale * log2(e) * the cache's k scale
    v_scale,  # the cache's v scale (1.0 unless FP8)
    first_req,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    window,  # sliding window W (read when SLIDING): query at p sees keys p - W + 1 .. p
    soft_cap,  # logit soft cap * log2(e) (read when SOFT_CAP)
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, Q_AS_FP16: tl.constexpr,
    SLIDING: tl.constexpr = False, SOFT_CAP: tl.constexpr = False,
    V_T: tl.constexpr = False,  # V blocks stored [Hkv, D, bs] (v_transposed); stride_vs is then 1
):  # fmt: skip
    q_block = tl.program_id(0)
    req = first_req + tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    m0 = q_block * BLOCK_M
    if m0 >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - query_len

    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if Q_AS_FP16:
        q = q.to(tl.float16)  # FP8 caches: the dots run in fp16 (see dot_dtype_fp16)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # Keys below ctx + m0 are visible to every row of the block (and lie inside seq_len).
    full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
    # The diagonal: the last row of the block sees keys up to ctx + m0 + BLOCK_M - 1.
    end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    diag_start = full_end
    if SLIDING:
        # one loop from the first row's first key, causal and window masks on every tile; the
        # two loops below then run no iteration
        lo = tl.maximum(ctx + m0 - window + 1, 0)
        if V_T:
            lo = (lo // BLOCK_SIZE) * BLOCK_SIZE  # tiles on block boundaries; the window mask holds
        for n0 in range(lo, end, BLOCK_N):
            keys = n0 + offs_n
            key_mask = keys < end
            qpos = ctx + rows[:, None]
            valid = key_mask[None, :] & (keys[None, :] <= qpos) & (keys[None, :] > qpos - window)
            acc, m_i, l_i = _attend_keys(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, keys, key_mask, end, valid, kv_head, dims,
                dim_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
                BLOCK_SIZE, DOT_PRECISION, soft_cap, SOFT_CAP, V_T)  # fmt: skip
        full_end = 0
        diag_start = end
    for n0 in range(0, full_end, BLOCK_N):
        keys = n0 + offs_n
        key_mask = keys < full_end
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, keys, key_mask, full_end, key_mask[None, :],
            kv_head, dims, dim_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            BLOCK_SIZE, DOT_PRECISION, soft_cap, SOFT_CAP, V_T)  # fmt: skip

    for n0 in range(diag_start, end, BLOCK_N):
        keys = n0 + offs_n
        key_mask = keys < end
        valid = key_mask[None, :] & (keys[None, :] <= ctx + rows[:, None])
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, keys, key_mask, end, valid, kv_head, dims,
            dim_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            BLOCK_SIZE, DOT_PRECISION, soft_cap, SOFT_CAP, V_T)  # fmt: skip

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (v_scale / l_i)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), sized so the tiles fit in shared memory."""
    # On an H200 (bf16, D=128, 2026-11-29 sweep in benchmarks/kernels_bench.py), 64x64 tiles with
    # 4 warps beat 128x64/8 warps, 128x64/4 warps/3 stages and 128x128/8 warps by 5-45%.
    block_d = next_power_of_2(head_dim)
    if dtype == torch.float32 or block_d > 128:
        return 64, 32, 4, 2
    return 64, 64, 4, 2


def prefill_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    out: torch.Tensor,  # [T, Hq, D], rows of requests first_req .. first_req+num_reqs-1 written
    scale: float,
    first_req: int,
    num_reqs: int,
    max_query_len: int,  # upper bound of query_len over those requests
    config: tuple[int, int, int, int] | None = None,
    k_scale: float = 1.0,  # the cache's scales: real K/V = stored * scale
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of requests [first_req, first_req + num_reqs) over their paged context
    (within the last `sliding_window` keys of each query, scores soft-capped, when given)."""
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if num_reqs == 0 or max_query_len == 0:
        return out
    assert hq % hkv == 0 and out.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_layout_ok(v_cache)
    q = _last_dim_contiguous(q)
    block_m, block_n, num_warps, num_stages = config or _prefill_config(d, q.dtype)
    grid = (triton.cdiv(max_query_len, block_m), num_reqs, hq)
    window_cap, switches = window_cap_args(sliding_window, logits_soft_cap)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E * k_scale, v_scale, first_req,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *window_cap, GROUP=hq // hkv, HEAD_DIM=d, BLOCK_SIZE=bs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_power_of_2(d),
        DOT_PRECISION=_dot_precision(q.dtype), Q_AS_FP16=dot_dtype_fp16(q.dtype, k_cache.dtype), **switches,
        V_T=v_transposed(v_cache), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
