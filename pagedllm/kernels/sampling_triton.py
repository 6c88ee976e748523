"""Triton sampling for the common case: each row greedy or drawn at its temperature from the
whole vocabulary (no top-k / top-p / min-p, no per-request seed). The logits are read once,
each row split over a few programs (`sample_triton`), each keeping a running argmax of

    greedy row:  x                                   (the argmax, first index on ties)
    random row:  x / T + g,   g = -log(-log(u)),  u ~ U[0, 1) from Philox (tl.rand4x: one
                 draw of the generator gives four columns' uniforms), in base 2 (`_take`)

which draws token i with probability softmax(x / T)_i (the Gumbel-max trick; the same law as
`sampler.sample`'s exponential race, from other random numbers). It replaces the
divide / softmax / exponential / divide / argmax / where sequence of the torch path, about a
millisecond a step for 256 rows of a 152K vocabulary on an H200, with one pass. u = 0 gives
g = -inf: that token is just not drawn, never a NaN.

The seed is read from a device tensor (drawn from the engine's generator) so that no step waits
for the host. A structured-output grammar's packed bitmask (bit b of word w of a row allows
token 32 w + b; structured_output/matcher.py) is read in the same pass: a row mapped to a
bitmask row draws only among the tokens it allows."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagedllm.kernels._triton import next_power_of_2


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2: the hardware approximation (lg2.approx, relative error ~2^-22) on the GPU; the
    accurate one under the interpreter, which lacks it."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _take(best, best_i, base, cols, hi, u, greedy, inv_t, mask_base, mrow, HAS_MASK: tl.constexpr,
          FAST_LOG: tl.constexpr):  # fmt: skip
    """One tile's scores folded into the running argmax (strictly greater: a lane keeps its
    first column on ties, as it sees its columns in increasing order). A drawn row's score is
    (x / T + g) log2(e) up to a constant, g = -ln(-ln u): -log2(-log2 u) = g log2(e) - log2(log2 e),
    which ranks the columns as x / T + g does."""
    m = cols < hi
    x = tl.load(base + cols, mask=m, other=float("-inf")).to(tl.float32)
    if greedy:
        s = x
    else:
        s = x * inv_t - _log2(-_log2(u, FAST_LOG), FAST_LOG)
    if HAS_MASK:
        words = tl.load(mask_base + cols // 32, mask=m, other=0)  # row 0's for an unmapped row: in bounds
        keep = (((words >> (cols % 32)) & 1) != 0) | (mrow < 0)
        s = tl.where(keep, s, float("-inf"))
    s = tl.where(m, s, float("-inf"))
    upd = s > best
    return tl.where(upd, s, best), tl.where(upd, cols, best_i)


# the chunk count takes whatever value the batch size gives: not specialized (Triton would
# compile other variants for 1 and for multiples of 16, e.g. Llama-3's 16 and 32 chunks)
@triton.jit(do_not_specialize=["chunks"])
def _sample_kernel(
    logits_ptr,  # [S, V] float32 or 16-bit
    stride,
    temp_ptr,  # [S] float32
    greedy_ptr,  # [S] bool (as int8)
    seed_ptr,  # [1] int64
    out_ptr,  # [S] int64 (one chunk), else unused
    part_val_ptr,  # [S, chunks] float32: each chunk's best score (SPLIT)
    part_idx_ptr,  # [S, chunks] int32: its first index
    mask_ptr,  # [G, W] int32 packed bitmask (HAS_MASK)
    mask_stride,
    mask_row_ptr,  # [S] int32: the row's bitmask row, -1 for none (HAS_MASK)
    V,
    chunks,
    chunk_len,  # columns a chunk covers (a multiple of BLOCK)
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy = tl.load(greedy_ptr + row) != 0
    mrow = 0
    mbase = mask_ptr
    if HAS_MASK:
        mrow = tl.load(mask_row_ptr + row)
        mbase = mask_ptr + tl.maximum(mrow, 0).to(tl.int64) * mask_stride
    inv_t = 1.4426950408889634 / tl.load(temp_ptr + row)  # log2(e) / T
    seed = tl.load(seed_ptr).to(tl.int32)
    Q: tl.constexpr = BLOCK // 4
    best = tl.full([Q], float("-inf"), tl.float32)
    best_i = tl.zeros([Q], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, V)
    i = tl.arange(0, Q)
    for start in range(lo, hi, BLOCK):
        # one Philox draw gives the uniforms of four columns, Q apart; its counter is indexed by
        # column (not by program), so the draw does not depend on the chunk count
        u0, u1, u2, u3 = tl.rand4x(seed, row * V + start // 4 + i)
        best, best_i = _take(best, best_i, base, start + i, hi, u0, greedy, inv_t, mbase, mrow,
                             HAS_MASK, FAST_LOG)
        best, best_i = _take(best, best_i, base, start + Q + i, hi, u1, greedy, inv_t, mbase, mrow,
                             HAS_MASK, FAST_LOG)
        best, best_i = _take(best, best_i, base, start + 2 * Q + i, hi, u2, greedy, inv_t, mbase, mrow,
                             HAS_MASK, FAST_LOG)
        best, best_i = _take(best, best_i, base, start + 3 * Q + i, hi, u3, greedy, inv_t, mbase, mrow,
                             HAS_MASK, FAST_LOG)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_i, V), axis=0)
    if SPLIT:
        tl.store(part_val_ptr + row * chunks + chunk, top)
        tl.store(part_idx_ptr + row * chunks + chunk, idx)
    else:
        tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit(do_not_specialize=["chunks"])
def _sample_reduce_kernel(part_val_ptr, part_idx_ptr, out_ptr, V, chunks, BLOCK_C: tl.constexpr):
    """A row's token from its chunks' bests: the highest score, the first index on ties (as one
    pass over the row would pick)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    m = c < chunks
    val = tl.load(part_val_ptr + row * chunks + c, mask=m, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * chunks + c, mask=m, other=V)
    top = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(val == top, idx, V), axis=0).to(tl.int64))


# programs to aim for: a few per SM of a large GPU, so that a handful of rows still fills it
_TARGET_PROGRAMS = 1024
# the reduction reads up to this many chunks at once whatever the batch (one compile); only a
# caller's small `block` over a large vocabulary has more possible chunks
_MAX_REDUCE_WIDTH = 1024


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  seed: torch.Tensor, bitmask: torch.Tensor | None = None,
                  bitmask_rows: torch.Tensor | None = None, *, chunks: int | None = None,
                  block: int | None = None) -> torch.Tensor:
    """logits [S, V] float32, temperature [S] (any value where greedy), greedy [S] bool,
    seed [1] int64 on the device -> token ids [S] int64. With a bitmask [G, ceil(V / 32)] int32
    and bitmask_rows [S] int32 (row -> bitmask row, -1 = unconstrained), row r draws only the
    tokens its bitmask row allows.

    Each row is split into `chunks` column ranges, one program each (by default as many as bring
    the programs near _TARGET_PROGRAMS: one program per row leaves most of the GPU idle at a few
    rows and streams a 152K-token row serially at 256), and a second kernel picks each row's best
    of its chunks. The random numbers are indexed by column, so the draw is the same for any
    `chunks`; `block` (the columns a program reads at once, a power of two >= 4) groups the
    columns that share a Philox draw, so it changes the draw. The chunk count is a runtime
    value and the reduction is as wide as the most chunks a row of V columns can have: the many
    batch sizes of a run compile no new kernels. (A width of next_power_of_2(chunks) compiled a
    new reduction each time the running batch crossed a power of two: five times as W1's batch
    grows to 256, as many compiles as W1's timed run showed on the H200, each stalling a step.)"""
    s, v = logits.shape
    if s * v >= 2**31:
        raise ValueError(f"sample_triton: {s} rows x {v} tokens exceed the int32 random offsets")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s == 0:
        return out
    block = block or max(4, min(2048, next_power_of_2(v)))
    blocks = triton.cdiv(v, block)
    if chunks is None:
        chunks = triton.cdiv(_TARGET_PROGRAMS, s)
    chunks = max(1, min(chunks, blocks))
    chunk_len = triton.cdiv(blocks, chunks) * block
    chunks = triton.cdiv(v, chunk_len)  # none empty
    has_mask = bitmask is not None
    if has_mask:
        assert bitmask_rows is not None and bitmask.dtype == torch.int32 and bitmask.stride(1) == 1
        mask, mask_rows = bitmask, bitmask_rows.to(torch.int32)
    else:
        mask, mask_rows = out, out  # not read
    if chunks > 1:
        part_val = torch.empty((s, chunks), dtype=torch.float32, device=logits.device)
        part_idx = torch.empty((s, chunks), dtype=torch.int32, device=logits.device)
    else:
        part_val = part_idx = out  # not written
    _sample_kernel[(s, chunks)](logits, logits.stride(0), temperature.float().contiguous(),
                                greedy.view(torch.int8) if greedy.dtype == torch.bool else greedy.to(torch.int8),
                                seed, out, part_val, part_idx, mask, mask.stride(0),
                                mask_rows, v, chunks, chunk_len, BLOCK=block, SPLIT=chunks > 1,
                                HAS_MASK=has_mask, FAST_LOG=os.environ.get("TRITON_INTERPRET") != "1",
                                num_warps=8 if block >= 2048 else 4)
    if chunks > 1:
        width = next_power_of_2(blocks) if blocks <= _MAX_REDUCE_WIDTH else next_power_of_2(chunks)
        _sample_reduce_kernel[(s,)](part_val, part_idx, out, v, chunks, BLOCK_C=width, num_warps=1)
    return out
