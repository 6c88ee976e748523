"""Triton paged decode attention: one query token per request, split-K along the context, then
a reduce kernel that merges the partial softmaxes; must equal the decode rows of
`paged_attention_torch` (pagedllm/attention/torch_backend.py). The tile helpers are shared with
the prefill kernel in attention.py.

Decode split-K: request r's context is cut into num_splits partitions of equal length (rounded
up to BLOCK_N). Each program handles one (request, kv head, partition) and all the query heads
of that kv head's group (GQA), and leaves an unnormalised output plus the running max and sum
of its partition; the reduce kernel rescales and merges them. With one split the first kernel
writes the final output itself. The split count is a runtime value (the grid's third
dimension), so a step with a new count compiles nothing. A sliding-window layer splits only the
window's keys [seq_len - W, seq_len); a soft-capped one caps each score (see _attend_tile).

The merge of the partials -- the reduce kernel, or the last split of each (request, kv head)
merging them (decode_last_reduce) -- lives in attention_merge.py.

ROPE (a `DecodeRope`; on by default, PAGEDLLM_FUSED_ROPE_DECODE=0 off): the kernel reads its query
heads from the qkv projection's rows and does qkv_rope's work for a step of decodes itself (see the
kernel). With it, PRELOAD (small grids; on by default, PAGEDLLM_DECODE_PRELOAD=0 off) loads each
split's first tile of keys and values before the PDL wait: in such a step no other kernel stores
this layer's keys, and the tile's row of the step's own key, stale until this kernel stores it, is
replaced by that key from registers.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import env_flag, next_power_of_2, num_sms, pdl
from pagedllm.kernels.attention import (
    _LOG2E,
    _attend_keys,
    _attend_tile,
    _dot_precision,
    _last_dim_contiguous,
    _load_kv_tile,
    dot_dtype_fp16,
    v_layout_ok,
    v_transposed,
    window_cap_args,
)
from pagedllm.kernels.attention_merge import (
    MERGE_BLOCK_S,
    MERGE_UNROLL,
    _decode_reduce_kernel,
    _merge_splits,
    decode_last_reduce,
)
from pagedllm.kernels.counters import counters
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.qkv_rope import DecodeRope
from pagedllm.kernels.qkv_rope_triton import _norm_rope_heads, _rounded_row


@triton.jit
def _window_first(seq_len, window, SLIDING: tl.constexpr, ALIGN: tl.constexpr):
    """The first key the splits share out: 0, or a sliding window's first key seq_len - W,
    rounded down to a multiple of ALIGN (a V cache read key-major starts tiles on block
    boundaries; the keys below the window are then masked by the caller)."""
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
        if ALIGN > 1:
            first = (first // ALIGN) * ALIGN
    return first


@triton.jit
def _partition(seq_lens_ptr, order_ptr, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
               ORDERED: tl.constexpr, ALIGN: tl.constexpr = 1):  # fmt: skip
    """This program's (request, kv head, split) and its keys [start, end): the request's context
    (a sliding window's last W keys) cut into the grid's num_splits partitions of whole tiles.
    The grid is (requests, kv heads, splits); ORDERED: (kv heads, requests, splits), the
    requests taken in `order` (longest context first, say). Programs launch x-fastest, so all
    kv heads of one request start before the next request's: the longest work starts first and
    the short work fills the grid's tail. (Both indices stay program ids: decoding them from one
    linear id cost the kernel 18 more registers, one CTA less per SM.)"""
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    if ORDERED:
        req = tl.load(order_ptr + tl.program_id(1), cache_modifier=".cg").to(tl.int64)
        kv_head = tl.program_id(0)
        num_kv_heads = tl.num_programs(0)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + req, cache_modifier=".cg")  # (.cg: may come before the PDL wait)
    # the window's keys [seq_len - W, seq_len) are what the splits share out
    first = _window_first(seq_len, window, SLIDING, ALIGN)
    part_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * part_len
    return req, kv_head, num_kv_heads, split, num_splits, start, tl.minimum(start + part_len, seq_len)


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, Hq, D], one query token per request
    k_cache_ptr,  # [N, bs, Hkv, D]
    v_cache_ptr,  # [N, bs, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    order_ptr,  # [B] int32: the requests in the order the programs take them (read when ORDERED)
    out_ptr,  # [B, Hq, D], written when there is one split
    part_out_ptr,  # [B, Hq, num_splits, D] float32, unnormalised partial outputs
    part_max_ptr,  # [B, Hq, num_splits] float32, running max (base 2)
    part_sum_ptr,  # [B, Hq, num_splits] float32, running sum of exp2
    count_ptr,  # [B * Hkv] int32, zero between calls (read when LAST_REDUCE)
    qk_scale,  # softmax scale * log2(e) * the cache's k scale
    v_scale,  # the cache's v scale (1.0 unless FP8)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    window,  # sliding window W (read when SLIDING): the last W keys are attended
    soft_cap,  # logit soft cap * log2(e) (read when SOFT_CAP)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_AS_FP16: tl.constexpr,
    SLIDING: tl.constexpr = False, SOFT_CAP: tl.constexpr = False, ORDERED: tl.constexpr = False,
    LAST_REDUCE: tl.constexpr = False,  # (SPLIT) the last split of a (request, kv head) merges them all
    BLOCK_S: tl.constexpr = MERGE_BLOCK_S,  # (LAST_REDUCE) splits' maxima read a round
    MERGE_UNROLL: tl.constexpr = MERGE_UNROLL,  # (LAST_REDUCE) splits merged a round
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
    V_T: tl.constexpr = False,  # V blocks stored [Hkv, D, bs] (attention.v_transposed); stride_vs is then 1
    # ROPE: q_ptr is the qkv projection's output (row stride_qt, heads stride_qh = D: q heads,
    # then k, then v), and this kernel does qkv_rope's work for its decodes: norms (HAS_NORM) and
    # rotates its query heads, and the program whose split holds the request's last key norms,
    # rotates and stores that key and its value into the cache (of q's dtype) before it attends
    ROPE: tl.constexpr = False,
    pos_ptr=None, cos_ptr=None, sin_ptr=None,  # [B] positions; [max_pos, D] float32 tables
    qw_ptr=None, kw_ptr=None,  # [D] q_norm / k_norm weights (HAS_NORM)
    slot_ptr=None,  # [B] int64 cache slots, -1 = not stored
    stride_cos=0, stride_sin=0, eps=0.0,
    HAS_NORM: tl.constexpr = False,
    # (ROPE, not V_T) the split's first tile of keys and values loaded before the PDL wait: only
    # the step's own key is new, and it comes from this kernel's registers (PAGEDLLM_DECODE_PRELOAD)
    PRELOAD: tl.constexpr = False,
):  # fmt: skip
    pdl_release(PDL)
    # The split count is the grid's third dimension, a runtime value: a new count (it follows
    # the batch size and the longest context) needs no new compile, which would stall serving
    # for a second or more. SPLIT (count > 1) picks partial outputs over the final one.
    # The partition reads only the step's inputs (seq_lens, order): before the PDL wait
    # (pdl_triton.py, rule 1), off the critical path.
    req, kv_head, num_kv_heads, split, num_splits, start, end = _partition(
        seq_lens_ptr, order_ptr, window, BLOCK_N, SLIDING, ORDERED, BLOCK_SIZE if V_T else 1)
    g = tl.arange(0, BLOCK_G)  # rows: the query heads of this kv head's group (padded to >= 16)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    if ROPE:  # the position's rotary rows, the token's slot (step inputs and tables: before the wait too)
        act = q_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + req, cache_modifier=".cg").to(tl.int64)
        cos = _rounded_row(cos_ptr + pos * stride_cos, dims, dim_mask, act)
        sin = _rounded_row(sin_ptr + pos * stride_sin, dims, dim_mask, act)
        slot = tl.load(slot_ptr + req, cache_modifier=".cg").to(tl.int64)
        # whether this split holds the last key, the step's own (none for padding: seq_len 0, slot -1)
        new_key = (start < end) & (end == tl.load(seq_lens_ptr + req, cache_modifier=".cg")) & (slot >= 0)
    bt_row = block_tables_ptr + req * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    if PRELOAD:  # the keys [start, start + BLOCK_N): earlier steps stored them (rule 1's exception, above)
        keys0 = start + offs_n
        mask0 = keys0 < end
        k0 = _load_kv_tile(k_cache_ptr, bt_row, keys0, mask0, kv_head, dims, dim_mask, stride_kb, stride_ks,
                           stride_kh, BLOCK_SIZE, ".cg")  # fmt: skip
        v0 = _load_kv_tile(v_cache_ptr, bt_row, keys0, mask0, kv_head, dims, dim_mask, stride_vb, stride_vs,
                           stride_vh, BLOCK_SIZE, ".cg")  # fmt: skip
    pdl_wait(PDL)

    if ROPE:
        row = q_ptr + req * stride_qt
        q = _norm_rope_heads(row, heads, g_mask, dims, dim_mask, cos, sin, qw_ptr, eps, stride_qh, HEAD_DIM,
                             HAS_NORM)  # fmt: skip
        if new_key:  # store it before the loop reads it
            kh = kv_head + tl.arange(0, 1)
            cdt = k_cache_ptr.dtype.element_ty
            k_new = _norm_rope_heads(row + GROUP * num_kv_heads * stride_qh, kh, kh >= 0, dims, dim_mask, cos,
                                     sin, kw_ptr, eps, stride_qh, HEAD_DIM, HAS_NORM).to(cdt)  # fmt: skip
            v_new = tl.load(row + (GROUP + 1) * num_kv_heads * stride_qh + kh[:, None] * stride_qh + dims[None, :],
                            mask=dim_mask[None, :], other=0.0).to(cdt)  # fmt: skip
            if PRELOAD:  # the preloaded tile holds the slot's stale row (if the key is in it): this key instead
                own = (keys0 == end - 1)[:, None]
                k0 = tl.where(own, k_new, k0)
                v0 = tl.where(own, v_new, v0)
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + kh[:, None] * stride_kh + dims[None, :],
                     k_new, mask=dim_mask[None, :])  # fmt: skip
            tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + kh[:, None] * stride_vh + dims[None, :],
                     v_new, mask=dim_mask[None, :])  # fmt: skip
            tl.debug_barrier()  # every thread's stores before any thread's loads of the tiles
    else:
        q = tl.load(
            q_ptr + req * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=g_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
    if Q_AS_FP16:
        q = q.to(tl.float16)  # FP8 caches: the dots run in fp16 (see dot_dtype_fp16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    win_lo = 0
    if SLIDING and V_T:  # the partitions start on a block boundary below the window: mask those keys
        win_lo = tl.maximum(tl.load(seq_lens_ptr + req) - window, 0)
    first = start
    if PRELOAD:
        if start < end:
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k0, v0, mask0[None, :], qk_scale, DOT_PRECISION,
                                         soft_cap, SOFT_CAP)  # fmt: skip
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        keys = n0 + offs_n
        key_mask = keys < end
        valid = key_mask[None, :]
        if SLIDING and V_T:
            valid = valid & (keys >= win_lo)[None, :]
        acc, m_i, l_i = _attend_keys(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, bt_row, keys, key_mask, end, valid, kv_head, dims,
            dim_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            BLOCK_SIZE, DOT_PRECISION, soft_cap, SOFT_CAP, V_T)  # fmt: skip

    acc = acc * v_scale
    if not SPLIT:
        # seq_len 0 (a padded CUDA-graph slot) gives l = 0: write zeros, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + req * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & dim_mask[None, :],
        )
    else:
        row = (req * (GROUP * num_kv_heads) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=g_mask[:, None] & dim_mask[None, :],
        )
        if LAST_REDUCE:
            # every thread's stores before the barrier, the barrier before the count, whose
            # release publishes them at gpu scope (and whose acquire, in the last split, orders
            # its loads of the partials after it)
            tl.debug_barrier()
            counter = count_ptr + req * num_kv_heads + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                # the splits holding keys: _partition's cut of the request's context
                seq_len = tl.load(seq_lens_ptr + req)
                num_keys = seq_len - _window_first(seq_len, window, SLIDING, BLOCK_SIZE if V_T else 1)
                part_len = tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
                live = tl.cdiv(num_keys, tl.maximum(part_len, 1))
                _merge_splits(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, row - split, num_splits, live,
                              req * stride_ot + heads * stride_oh, g_mask, dims, dim_mask, HEAD_DIM, BLOCK_S,
                              MERGE_UNROLL)  # fmt: skip
                tl.store(counter, 0)  # zero again for the next call (or graph replay)


# H200 sweep: batch 1 over 1K tokens ran fastest with 8 splits (128 tokens each), over 32K
# tokens with 64; more splits only cost the reduce kernel a little.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 64
def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Partitions per sequence: enough programs to fill about two waves of the GPU, but no
    partition shorter than MIN_TOKENS_PER_SPLIT. Depends only on its arguments, so a CUDA graph
    captured for a batch size (with max_seq_len an upper bound) replays the same grid."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = triton.cdiv(2 * num_sms, programs)
    cap = triton.cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))


# (BLOCK_N, num_warps, num_stages) of the decode kernel by the cache's bytes per element. H200,
# benchmarks/decode_sweep.py at W1's shape (256 requests, Qwen3-0.6B heads; RESULTS.md, ninth
# session): FP8 128/4/3 255.6 us vs 64/4/2 291.8 (a tile of 64 FP8 keys moves too few bytes per
# iteration; the FP8 kernel is bound by its per-element work, not by HBM), and W1 with an FP8
# cache 26,113 vs 23,435 tok/s. bf16: 64/4/3 was 1.3% faster in the sweep (302.6 vs 306.5 us) but
# not in W1 (alternated: 22,478 / 22,703 tok/s with 64/4/2, 21,670 with 64/4/3), so it stays.
# float32 (the CPU interpreter's tests) keeps 32 keys. (A CUDA-core variant for small groups,
# tried in the ninth session, lost to this kernel at every tile for both caches on the H200 and
# was removed: RESULTS.md, tenth session.)
DECODE_CONFIGS = {2: (64, 4, 2), 1: (128, 4, 3), 4: (32, 4, 2)}
# A register cap per thread (ptxas maxnreg; None: ptxas's choice) by the cache's bytes per element.
# The FP8 kernel takes 128 registers at 128/4/3, four CTAs an SM; at 96 it compiles without spills
# (sm_90, Triton 3.6: 25.7 instructions a key against 24.9) and five CTAs fit (41.5 KB of shared
# memory each). It is latency-bound (about 27% of issue), so a fifth CTA may pay: not yet measured
# (`PAGEDLLM_DECODE_CONFIG=128,4,3,96`; benchmarks/decode_sweep.py --maxnreg-ab).
DECODE_MAXNREG: dict[int, int | None] = {2: None, 1: None, 4: None}


@functools.cache
def decode_config(cache_itemsize: int) -> tuple[int, int, int, int | None]:
    """(BLOCK_N, num_warps, num_stages, maxnreg) of the decode kernel for a cache of
    `cache_itemsize` bytes per element; PAGEDLLM_DECODE_CONFIG="block_n,warps,stages[,maxnreg]"
    overrides it (benchmarks/decode_gpu.sh compares configs in the engine; read once per process)."""
    raw = os.environ.get("PAGEDLLM_DECODE_CONFIG", "").strip()
    if not raw:
        return (*DECODE_CONFIGS[cache_itemsize], DECODE_MAXNREG[cache_itemsize])
    parts = [p.strip() for p in raw.split(",")]
    ok = len(parts) in (3, 4) and all(p.isdigit() for p in parts)
    block_n, warps, stages, *cap = [int(p) for p in parts] if ok else [0, 0, 0]
    maxnreg = cap[0] if cap else None
    if (block_n < 16 or block_n & (block_n - 1) or warps < 1 or stages < 1
            or (maxnreg is not None and not 32 <= maxnreg <= 255)):
        raise ValueError(f"PAGEDLLM_DECODE_CONFIG must be 'block_n,warps,stages[,maxnreg]' (block_n a power of 2 "
                         f">= 16, maxnreg 32-255), got {raw!r}")
    return block_n, warps, stages, maxnreg


# PRELOAD (on by default, PAGEDLLM_DECODE_PRELOAD=0 off): the decode kernel doing qkv_rope's
# work (ROPE) loads its split's first tile before its PDL wait when the grid has at most this many
# programs a multiprocessor: batch-1 decodes (Qwen3-30B-A3B's 4 kv heads x 32 splits, Llama-3.1-8B's
# 8 x 4), which would then take the tile while the q/k/v projection still streams, instead of after
# it (the tile's block-table and cache loads on the step's chain): W2 gptq 2.60 -> 2.565 ms/token on an H100,
# Qwen3-30B-A3B batch 1 even (3.235 / 3.24; RESULTS.md, thirty-fifth session); a full grid (W1's 256 requests)
# keeps the registers the tile holds (158-160 against 95-96 on sm_90, Triton 3.9).
PRELOAD_MAX_WAVES = 2


@functools.cache
def _preload_on() -> bool:
    """PAGEDLLM_DECODE_PRELOAD: 1 or unset the rule above, 0 never (read once)."""
    return env_flag("PAGEDLLM_DECODE_PRELOAD", default=True)


def decode_preload(programs: int, num_sms_: int) -> bool:
    """Whether a ROPE decode grid of `programs` programs preloads its first tile (PRELOAD)."""
    return _preload_on() and programs <= PRELOAD_MAX_WAVES * num_sms_


def rope_decode_ok(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel can take a step's qkv rows itself (ROPE): a cache of the
    activations' own dtype (16-bit or float32: not FP8, whose scales and key-major V blocks it
    does not store), V stored head_dim-contiguous, an even head_dim, qkv's last dim contiguous.
    (A layer whose cache takes scales or a K offset does not ask: model/layers/attention.py.)"""
    return (k_cache.dtype == qkv.dtype and k_cache.element_size() >= 2 and not v_transposed(v_cache)
            and k_cache.shape[-1] % 2 == 0 and qkv.stride(-1) == 1)


def decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D], row i = the query token of request i (rope: a view of the qkv rows)
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (rows beyond B are ignored)
    seq_lens: torch.Tensor,  # [B] int32 (entries beyond B are ignored)
    out: torch.Tensor,  # [B, Hq, D]
    scale: float,
    max_seq_len: int,  # upper bound of seq_lens; picks the split count only
    num_splits: int | None = None,  # None: decode_num_splits(...)
    block_n: int | None = None,  # the tiles (None: decode_config's)
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,  # a register cap per thread (None: decode_config's, which may be None)
    k_scale: float = 1.0,  # the cache's scales: real K/V = stored * scale
    v_scale: float = 1.0,
    sliding_window: int | None = None,  # attend to the last sliding_window keys only
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
    order: torch.Tensor | None = None,  # [>= B] int32: the requests in the order programs take them
    last_reduce: bool | None = None,  # with splits: the last split merges them (None: decode_last_reduce)
    merge_unroll: int | None = None,  # (last_reduce) splits merged a round (None: MERGE_UNROLL)
    rope: DecodeRope | None = None,  # q is qkv[:, :Hq * D] viewed [B, Hq, D]: norm, rotate, store K/V here
    preload: bool | None = None,  # (rope) the first tile before the PDL wait (None: decode_preload)
) -> torch.Tensor:
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if b == 0:
        return out
    assert hq % hkv == 0 and out.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_layout_ok(v_cache)
    if rope is not None:
        # (one row: torch may give the view any row stride; the kernel then reads row 0 only)
        assert q.stride(1) == d and (b == 1 or q.stride(0) >= (hq + 2 * hkv) * d) and rope.cos_cache.shape[-1] == d, \
            "rope: q must view the qkv rows [B, (Hq + 2 Hkv) * D], the rotary tables D wide"
        assert rope_decode_ok(q, k_cache, v_cache)
    q = _last_dim_contiguous(q)
    group = hq // hkv
    num_sms_ = num_sms(q.device.index or 0) if q.is_cuda else 1
    if num_splits is None:
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        num_splits = decode_num_splits(b, hkv, span, num_sms_)
    itemsize = 4 if q.dtype == torch.float32 else k_cache.element_size()
    cfg = decode_config(itemsize)
    block_n = block_n or cfg[0]
    num_warps = num_warps or cfg[1]
    num_stages = num_stages or cfg[2]
    maxnreg = maxnreg or cfg[3]
    block_d = next_power_of_2(d)
    if num_splits > 1:
        part_out = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_max = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_max = part_sum = out  # unused
    last = num_splits > 1 and (decode_last_reduce(num_splits, k_cache.element_size(), block_d) if last_reduce is None
                               else last_reduce)
    window_cap, switches = window_cap_args(sliding_window, logits_soft_cap)
    args = (
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if order is None else order, out, part_out, part_max,
        part_sum, counters(q.device, b * hkv) if last else seq_lens,
        scale * _LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *window_cap,
    )  # fmt: skip
    common = dict(GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=num_splits > 1,
                  ORDERED=order is not None, LAST_REDUCE=last, V_T=v_transposed(v_cache), **switches,
                  num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    if maxnreg is not None and q.is_cuda:  # (a ptxas option: nothing for the interpreter)
        common["maxnreg"] = maxnreg
    if rope is not None:
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (rope.cos_cache, rope.sin_cache))
        has_norm = rope.q_norm_weight is not None
        common.update(ROPE=True, pos_ptr=rope.positions, cos_ptr=cos, sin_ptr=sin, slot_ptr=rope.slot_mapping,
                      qw_ptr=rope.q_norm_weight if has_norm else cos, kw_ptr=rope.k_norm_weight if has_norm else cos,
                      stride_cos=cos.stride(0), stride_sin=sin.stride(0), eps=rope.eps, HAS_NORM=has_norm,
                      PRELOAD=decode_preload(b * hkv * num_splits, num_sms_) if preload is None else preload)
    if last:
        common.update(BLOCK_S=MERGE_BLOCK_S, MERGE_UNROLL=merge_unroll or MERGE_UNROLL)
    grid = (b, hkv, num_splits) if order is None else (hkv, b, num_splits)
    _decode_kernel[grid](
        *args, BLOCK_G=max(16, next_power_of_2(group)), DOT_PRECISION=_dot_precision(q.dtype),
        Q_AS_FP16=dot_dtype_fp16(q.dtype, k_cache.dtype), **common, **pdl(q),
    )  # fmt: skip
    if num_splits > 1 and not last:
        _decode_reduce_kernel[(b, hq)](
            part_out, part_max, part_sum, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=d, BLOCK_S=max(MAX_SPLITS, next_power_of_2(num_splits)), BLOCK_D=block_d,
            num_warps=4 if block_d <= 128 else 8, **pdl(q),
        )  # fmt: skip
    return out
