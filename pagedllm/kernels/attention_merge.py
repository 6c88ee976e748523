"""The second stage of Triton's paged decode attention (attention_decode.py): the decode kernel's
splits leave each query head an unnormalised output with the running max and sum of its partition,
and these are merged here -- rescaled to a common max and summed in split order.

Two ways: the reduce kernel (`_decode_reduce_kernel`, one program a (request, query head), launched
after the decode kernel), or "the last split merges" (decode_last_reduce): no reduce kernel runs;
after storing its partials, each decode program counts itself done on its (request, kv head)'s
counter (kernels/counters.py: a barrier, then an acq_rel atomic at gpu scope), and the split that
counts last merges all the splits in split order (`_merge_splits`, read back from the L2), writes
the output and sets the counter back to zero. Same grid and buffers, so CUDA graphs capture it
alike. By default it runs for 16-bit caches split at most LAST_REDUCE_MAX_SPLITS ways, where the
H200 measured it faster.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait


@triton.jit
def _merge_splits(part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, first, num_splits, live, out_offs, g_mask,
                  dims, dim_mask, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    """`_decode_reduce_kernel`'s merge for the query heads of one kv head, in split order: the
    partials at rows first + s (first: [BLOCK_G], each head's split 0) read from the L2 (.cg:
    the other programs' stores are there, never in this SM's L1), written to out_offs [BLOCK_G].
    Only the first `live` splits hold keys (the split count comes from the CUDA graph's bound, so
    at a short context most are empty: max -inf, sum 0); their maxima are read BLOCK_S a round,
    their outputs UNROLL a round, whose loads are independent (one L2 latency a round, not one a
    split)."""
    s_offs = tl.arange(0, BLOCK_S)
    m_max = tl.full(first.shape, float("-inf"), tl.float32)
    for s0 in range(0, live, BLOCK_S):  # the max over the live splits, BLOCK_S a round
        m_all = tl.load(part_max_ptr + first[:, None] + s0 + s_offs[None, :],
                        mask=g_mask[:, None] & (s0 + s_offs < live)[None, :], other=float("-inf"),
                        cache_modifier=".cg")  # fmt: skip
        m_max = tl.maximum(m_max, tl.max(m_all, axis=1))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all partitions empty (seq_len 0)
    total = tl.zeros(first.shape, tl.float32)
    acc = tl.zeros([first.shape[0], dims.shape[0]], tl.float32)
    for s0 in range(0, live, UNROLL):
        for j in tl.static_range(UNROLL):
            s = s0 + j
            ok = g_mask & ((tl.zeros_like(first) + s) < live)  # a vector mask (as the MoE kernel's)
            m_s = tl.load(part_max_ptr + first + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(part_sum_ptr + first + s, mask=ok, other=0.0, cache_modifier=".cg")
            part = tl.load(part_out_ptr + (first + s)[:, None] * HEAD_DIM + dims[None, :],
                           mask=ok[:, None] & dim_mask[None, :], other=0.0, cache_modifier=".cg")  # fmt: skip
            w = tl.exp2(m_s - m_max)  # an empty or absent split: exp2(-inf) = 0
            total += l_s * w
            acc += part * w[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + out_offs[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None] & dim_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,  # [B, Hq, num_splits, D] float32
    part_max_ptr,  # [B, Hq, num_splits] float32
    part_sum_ptr,  # [B, Hq, num_splits] float32
    out_ptr,  # [B, Hq, D]
    stride_ot, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
):  # fmt: skip
    pdl_release(PDL)
    pdl_wait(PDL)
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = req * tl.num_programs(1) + head
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    m = tl.load(part_max_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row * num_splits + s, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all partitions empty (seq_len 0)
    w = tl.exp2(m - m_max)  # empty partitions: exp2(-inf) = 0
    total = tl.sum(sums * w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    acc = tl.load(
        part_out_ptr + (row * num_splits + s[:, None]) * HEAD_DIM + dims[None, :],
        mask=s_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + req * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


# splits the last split's merge reads a round (PAGEDLLM_DECODE_LAST_REDUCE), their maxima and then
# their outputs: first guesses, within the registers of the kernel without splits on sm_90 (a
# [16, 64] tile of maxima took 109-113 at groups 4-8 against 94-96)
MERGE_BLOCK_S = 16
# H200 (thirteenth session, decode_sweep.py --last-reduce-ab): 8 a round beat 4 at 9 and 17 splits
# (x0.85-0.93 and x0.84-0.98 of the reduce kernel, Llama-3.1-8B's heads) and equalled it elsewhere
MERGE_UNROLL = 8


# The last split merges the splits when there are at most this many (16-bit caches). H200,
# benchmarks/decode_sweep.py --last-reduce-ab (RESULTS.md, twelfth session), last split / reduce
# kernel per layer: 9 splits x0.84-0.96 at every context of 128-4,096 tokens; 17 mixed
# (x0.83-1.05); 32 x0.81-0.91 below 1,024 tokens but x1.16-1.27 at 2,048-4,096, where one
# program's serial merge of 32 partials outlasts the reduce kernel's parallel one. (FP8 caches,
# whose kernel sits at 255 registers, were not measured: they keep the reduce kernel.)
LAST_REDUCE_MAX_SPLITS = 9


@functools.cache
def _last_reduce_forced() -> bool | None:
    """PAGEDLLM_DECODE_LAST_REDUCE: 1 always, 0 never, unset the measured rule (read once)."""
    value = os.environ.get("PAGEDLLM_DECODE_LAST_REDUCE", "").strip()
    return None if not value else value != "0"


# Triton 3.6 cannot compile the merge for 16-wide heads (BLOCK_D 16: an assertion in its
# OptimizeThreadLocality pass, met on the H200 by a tiny test model in the thirteenth session and
# reproduced by kernels/inspect_sm90.compile_sm90 on the CPU; 32 and wider compile): narrower heads
# keep the reduce kernel whatever PAGEDLLM_DECODE_LAST_REDUCE says.
LAST_REDUCE_MIN_BLOCK_D = 32


def decode_last_reduce(num_splits: int, cache_itemsize: int, block_d: int = 128) -> bool:
    """Whether the last of `num_splits` (> 1) splits merges them instead of a reduce kernel
    (heads padded to `block_d`)."""
    if block_d < LAST_REDUCE_MIN_BLOCK_D:
        return False
    forced = _last_reduce_forced()
    if forced is not None:
        return forced
    return cache_itemsize == 2 and num_splits <= LAST_REDUCE_MAX_SPLITS
