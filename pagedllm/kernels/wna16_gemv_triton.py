"""The few-row integer GEMVs of wna16_triton.py's product (layout: wna16.py), each equal to its
torch reference there:

    gemv (few rows, no tensor cores): a program owns BLOCK_N outputs of one row and a K range
      (SPLIT_K > 1: several programs per column block, the last of them adding the splits in split
      order from a workspace -- `_gemv_store`; float32 atomics under PAGEDLLM_SWAP_LAST_REDUCE=0). It streams
      [BLOCK_KW, BLOCK_N] tiles of words (coalesced along N) and takes the P values of each word
      apart without shifts where it can: `(word & mask) | 0x4B000000` read as a float is
      2**23 + q * 2**s exactly (s + bits <= 23), so one subtraction gives (q - zero) * 2**s and
      the activation is multiplied by 2**-s instead (exact: a power of two). Values above bit 23
      come from `word >> 16` the same way. Scales (and asymmetric zeros) are gathered per word
      row, so any BLOCK_KW works with any group size.
    gemvp (few rows, 4 bits, 16-bit activations; the default there, PAGEDLLM_WNA16_GEMV=plain keeps
      gemv): the gemv's tiles in packed 16-bit arithmetic, a word's two halves at a time, through
      inline PTX (`_wna16_gemv_packed_kernel`): about 23-26 instructions a word on sm_90 against
      42; W2 Llama-3.1-8B gptq on the H200 3.24 -> 2.96 ms/token.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.wna16_words_triton import _pair_bits, gemvp_word_sums

_MAGIC = tl.constexpr(0x4B000000)  # the bits of float32 2**23
_MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def kperm_input(s):
    """The input slot s holds in the steps-permuted K-packed layout (kernels/wna16.py's
    kperm_pack): within a step of 128, slot 8j + i + 4h holds input 32i + 2j + h."""
    r = s % 128
    return s - r + 32 * (r % 4) + 2 * (r // 8) + (r % 8) // 4


@triton.jit
def _gemv_finish(acc, s_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, m, rn, n_mask, pid_k, stride_om, M, N,
                 GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, LAST: tl.constexpr):  # fmt: skip
    """The GEMVs' end: the [BLOCK_KW, BLOCK_N] partial sums added over rows, the per-channel
    scale, the bias (split 0), stored (_gemv_store)."""
    y = tl.sum(acc, axis=0)
    if GROUP_K == 0:
        y = y * tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        if pid_k == 0:
            y = y + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    _gemv_store(y, out_ptr, ws_ptr, count_ptr, m, rn, n_mask, stride_om, M, N, SPLIT_K, LAST)


@triton.jit
def _gemv_store(y, out_ptr, ws_ptr, count_ptr, m, rn, n_mask, stride_om, M, N, SPLIT_K: tl.constexpr,
                LAST: tl.constexpr):  # fmt: skip
    """A GEMV program's part y [BLOCK_N] (float32) of row m: the output itself (one split), added
    into the float32 output by atomics, or (LAST) stored to the workspace, the split that counts
    itself last on its (row, column block) counter adding the splits in split order -- no memset
    or cast kernel around the GEMV, the same sum every call (kernels/counters.py)."""
    out = out_ptr + m * stride_om + rn
    if SPLIT_K == 1:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    elif LAST:
        tl.store(ws_ptr + (tl.program_id(2) * M + m) * N + rn, y, mask=n_mask)
        # every thread's stores before the barrier, the barrier before the count, whose release
        # publishes them at gpu scope (and whose acquire orders the last split's loads after it)
        tl.debug_barrier()
        counter = count_ptr + m * tl.num_programs(1) + tl.program_id(1)
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros(rn.shape, dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                acc += tl.load(ws_ptr + (i * M + m) * N + rn, mask=n_mask, other=0.0, cache_modifier=".cg")
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.store(counter, 0)  # zero again for the next call (or graph replay)
    else:
        tl.atomic_add(out, y, mask=n_mask)


@triton.jit
def _wna16_gemv_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [K/P, N] int32
    s_ptr,  # [G, N] scales
    z_ptr,  # [G, N] zeros (read when HAS_ZERO)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N] (float32 when SPLIT_K > 1 and not LAST: atomically summed)
    ws_ptr,  # [SPLIT_K, M, N] float32 (read when LAST)
    count_ptr,  # int32 counters, zero between calls (LAST: one per row and column block)
    M, N, KW, KW_PER_SPLIT,
    stride_xm, stride_wk, stride_sg, stride_om,
    BITS: tl.constexpr, GROUP_K: tl.constexpr,  # GROUP_K 0: one scale row (per channel)
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
    LAST: tl.constexpr = False,  # (SPLIT_K > 1) the last split of a row's column block adds them (_gemv_store)
    KPERM: tl.constexpr = False,  # the steps-permuted layout: slot k meets input kperm_input(k)
):  # fmt: skip
    pdl_release(PDL)
    pdl_wait(PDL)
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    n_mask = rn < N
    ri = tl.arange(0, BLOCK_KW)
    x_row = x_ptr + m * stride_xm
    kw_lo = pid_k * KW_PER_SPLIT
    kw_hi = tl.minimum(kw_lo + KW_PER_SPLIT, KW)
    if HAS_ZERO and GROUP_K == 0:
        z_row = tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    for kw0 in range(kw_lo, kw_hi, BLOCK_KW):
        rows = kw0 + ri
        if EVEN:
            w = tl.load(w_ptr + rows[:, None] * stride_wk + rn[None, :], mask=n_mask[None, :], other=0)
        else:
            r_mask = rows < kw_hi
            w = tl.load(w_ptr + rows[:, None] * stride_wk + rn[None, :], mask=r_mask[:, None] & n_mask[None, :],
                        other=0)
        hi = w >> 16
        part = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_KW], dtype=tl.float32)
        for j in tl.static_range(P):
            xk = kperm_input(rows * P + j) if KPERM else rows * P + j
            if EVEN:
                xj = tl.load(x_row + xk).to(tl.float32)
            else:
                xj = tl.load(x_row + xk, mask=r_mask, other=0.0).to(tl.float32)
            if j * BITS + BITS <= 23:
                src = w
                sh = j * BITS
            else:
                src = hi
                sh = j * BITS - 16
            bits = (src & (MASK << sh)) | _MAGIC
            if HAS_ZERO:
                q = bits.to(tl.float32, bitcast=True) - _MAGIC_F  # q * 2**sh
                xsum += xj
            else:  # symmetric: the zero 2**(BITS-1) folds into the subtraction
                q = bits.to(tl.float32, bitcast=True) - (_MAGIC_F + (1 << (BITS - 1 + sh)))
            part += q * (xj * (1.0 / (1 << sh)))[:, None]
        if GROUP_K > 0:
            g = rows * P // GROUP_K
            s_off = g[:, None] * stride_sg + rn[None, :]
            if EVEN:
                s_mask = n_mask[None, :]
            else:
                s_mask = r_mask[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                z = tl.load(z_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
                part -= z * xsum[:, None]
            acc += part * s
        else:
            if HAS_ZERO:
                part -= z_row[None, :] * xsum[:, None]
            acc += part
    _gemv_finish(acc, s_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, m, rn, n_mask, pid_k, stride_om, M, N, GROUP_K,
                 HAS_BIAS, SPLIT_K, LAST)  # fmt: skip


@triton.jit
def _gemvp_x_offsets(rows, KPERM: tl.constexpr):
    """The int32 offset in x's row of each word row's first activation pair: (x0, x1) of its eight
    inputs, or (KPERM: word j of a step, int32 16i + j holding the inputs of nibbles i, i + 4) of its
    first nibble pair; the others 1-3 (16-48 on the steps-permuted layout) past it."""
    if KPERM:
        return (rows - rows % 16) * 4 + rows % 16
    return rows * 4


@triton.jit
def _wna16_gemv_packed_kernel(
    x_ptr,  # [M, K] activations, float16 or bfloat16 (rows 4-byte aligned: read as int32 pairs)
    w_ptr,  # [K/8, N] int32, 4-bit values
    s_ptr,  # [G, N] scales
    z_ptr,  # [G, N] zeros (read when HAS_ZERO)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N] (float32 when SPLIT_K > 1 and not LAST: atomically summed)
    ws_ptr,  # [SPLIT_K, M, N] float32 (read when LAST)
    count_ptr,  # int32 counters, zero between calls (LAST: one per row and column block)
    M, N, KW, KW_PER_SPLIT,
    stride_xm, stride_wk, stride_sg, stride_om,
    GROUP_K: tl.constexpr,  # 0: one scale row (per channel)
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    ASM: tl.constexpr = True,  # False: the PTX's steps in Triton ops (wna16_words_triton; the interpreter,
    # bfloat16 before sm_90: _triton.inline_ptx)
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
    LAST: tl.constexpr = False,  # (SPLIT_K > 1) the last split of a row's column block adds them (_gemv_store)
    PREFETCH: tl.constexpr = False,  # each iteration loads the next tile's words before it uses its own
    LOOP_STAGES: tl.constexpr = 1,  # > 1: Triton's software pipeline of the loop's loads (cp.async
    # through shared memory, LOOP_STAGES - 1 tiles ahead); PREFETCH then off
    KPERM: tl.constexpr = False,  # the steps-permuted layout: nibbles i, i + 4 of a word are x's pair
):  # fmt: skip
    """The 4-bit GEMV in packed 16-bit arithmetic (`gemvp`). The gemv kernel spends about 42
    instructions a word in float32 (sm_90 SASS), more than the SM issues at the memory's pace;
    here a word costs about 16 (fp16) / 19 (bf16) in wna16_words_triton's PTX: one lop3 takes two values as
    16-bit floats MAGIC + q, one subtraction (or fma) gives q - zero exactly, and the products
    with the activation pairs add up two lanes at a time over the word's eight inputs (rounded
    as 16-bit products and sums are), then in float32. The activation pairs (x_j, x_j+4) are
    assembled once per word row from the row read as int32 (x_2i, x_2i+1) pairs; in the
    steps-permuted layout (KPERM) those pairs are the activations of word j's nibbles (i, i + 4)
    themselves, int32 (16i + j) of j's step. Under PDL with
    PREFETCH the first tile's words (weights, which no kernel writes) are loaded before the wait,
    through L2 (pdl_triton.py's rule 1), while the kernel before finishes."""
    pdl_release(PDL)
    act: tl.constexpr = x_ptr.dtype.element_ty
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    n_mask = rn < N
    ri = tl.arange(0, BLOCK_KW)
    x_row = x_ptr + m * stride_xm
    x_words = x_row.to(tl.pointer_type(tl.int32))
    kw_lo = pid_k * KW_PER_SPLIT
    kw_hi = tl.minimum(kw_lo + KW_PER_SPLIT, KW)
    if GROUP_K == 0:
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn, mask=n_mask, other=0.0, cache_modifier=".cg" if PDL else "")
            zero = zero.to(tl.float32)[None, :]
        else:
            zero = tl.full([1, BLOCK_N], 8.0, tl.float32)
    acc = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    # PREFETCH: the addresses at the split's first tile, moved one tile on each iteration (no per-element
    # address arithmetic in the loop: sm_90 bf16 26.1 -> 23.8 instructions a word on the steps-permuted
    # layout, benchmarks/sass_counts.py; Triton's pipelined loops issue more that way: they keep theirs).
    # A tile's scale rows: one, kw0 * 8 // GROUP_K, where a group holds whole tiles (SCALE_ROW); else
    # kw0 * 8 // GROUP_K + ri * 8 // GROUP_K where a tile holds whole groups (NEST), moved with the tile.
    SCALE_ROW: tl.constexpr = PREFETCH and GROUP_K > 0 and GROUP_K % (BLOCK_KW * 8) == 0
    NEST: tl.constexpr = PREFETCH and GROUP_K > 0 and not SCALE_ROW and (BLOCK_KW * 8) % GROUP_K == 0
    if PREFETCH:  # the first tile's words, before the loop (and before the wait)
        w_ptrs = w_ptr + (kw_lo + ri)[:, None] * stride_wk + rn[None, :]
        w_next = tl.load(w_ptrs, mask=((kw_lo + ri) < kw_hi)[:, None] & n_mask[None, :], other=0,
                         cache_modifier=".cg" if PDL else "")
        x_next = _gemvp_x_offsets(kw_lo + ri, KPERM)
    if NEST:
        s_next = (kw_lo * 8 // GROUP_K + ri * 8 // GROUP_K)[:, None] * stride_sg + rn[None, :]
    pdl_wait(PDL)
    for kw0 in tl.range(kw_lo, kw_hi, BLOCK_KW, num_stages=LOOP_STAGES):
        rows = kw0 + ri
        if EVEN:
            r_mask = ri < BLOCK_KW
        else:
            r_mask = rows < kw_hi
        if PREFETCH:  # this tile's words came with the last iteration; the next tile's go out now
            w = w_next
            w_ptrs += BLOCK_KW * stride_wk
            if EVEN:  # (a splat of one predicate: the last iteration loads nothing)
                more = tl.full([BLOCK_KW, 1], kw0 + BLOCK_KW, tl.int32) < kw_hi
                w_next = tl.load(w_ptrs, mask=more & n_mask[None, :], other=0)
            else:
                w_next = tl.load(w_ptrs, mask=((rows + BLOCK_KW) < kw_hi)[:, None] & n_mask[None, :], other=0)
            x_ptrs = x_words + x_next
            x_next += BLOCK_KW * 4
        else:
            w = tl.load(w_ptr + rows[:, None] * stride_wk + rn[None, :], mask=r_mask[:, None] & n_mask[None, :],
                        other=0)
            x_ptrs = x_words + _gemvp_x_offsets(rows, KPERM)
        if GROUP_K > 0:
            if SCALE_ROW:  # (rows past the range: their words and x are 0, whatever the scale)
                s_off = (kw0 * 8 // GROUP_K) * stride_sg + rn[None, :]
                s_mask = n_mask[None, :]
            else:
                if NEST:
                    s_off = s_next
                    s_next += (BLOCK_KW * 8 // GROUP_K) * stride_sg
                else:
                    s_off = (rows * 8 // GROUP_K)[:, None] * stride_sg + rn[None, :]
                s_mask = r_mask[:, None] & n_mask[None, :]
            if HAS_ZERO:
                zero = tl.load(z_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            else:
                zero = tl.full([BLOCK_KW, BLOCK_N], 8.0, tl.float32)
        if KPERM:
            x04 = tl.load(x_ptrs, mask=r_mask, other=0)[:, None]
            x15 = tl.load(x_ptrs + 16, mask=r_mask, other=0)[:, None]
            x26 = tl.load(x_ptrs + 32, mask=r_mask, other=0)[:, None]
            x37 = tl.load(x_ptrs + 48, mask=r_mask, other=0)[:, None]
        else:
            xw0 = tl.load(x_ptrs, mask=r_mask, other=0)  # (x0, x1) of each word row
            xw1 = tl.load(x_ptrs + 1, mask=r_mask, other=0)  # (x2, x3)
            xw2 = tl.load(x_ptrs + 2, mask=r_mask, other=0)  # (x4, x5)
            xw3 = tl.load(x_ptrs + 3, mask=r_mask, other=0)  # (x6, x7)
            x04 = _pair_bits(xw0, xw2)[:, None]
            x15 = _pair_bits(xw0 >> 16, xw2 >> 16)[:, None]
            x26 = _pair_bits(xw1, xw3)[:, None]
            x37 = _pair_bits(xw1 >> 16, xw3 >> 16)[:, None]
        wsum = gemvp_word_sums(w, x04, x15, x26, x37, zero, act, ASM)
        if GROUP_K > 0:
            acc += wsum * tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        else:
            acc += wsum
    _gemv_finish(acc, s_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, m, rn, n_mask, pid_k, stride_om, M, N, GROUP_K,
                 HAS_BIAS, SPLIT_K, LAST)  # fmt: skip


def _rows_as_int32_pairs(x: torch.Tensor) -> bool:
    """Whether gemvp can read x's rows as int32 pairs (every row 4-byte aligned)."""
    return (x.shape[0] <= 1 or x.stride(0) % 2 == 0) and x.data_ptr() % 4 == 0


@functools.cache
def gemv_kind(dtype: torch.dtype) -> str:
    """The few-row 4-bit kernel for activations of `dtype`: "gemvp" (packed 16-bit arithmetic) for
    16-bit activations, "gemv" for float32 or under PAGEDLLM_WNA16_GEMV=plain. H200 (thirteenth
    session, RESULTS.md): W2 Llama-3.1-8B gptq 3.24 -> 2.96 ms/token. Read once per process."""
    plain = os.environ.get("PAGEDLLM_WNA16_GEMV", "").strip() == "plain"
    return "gemv" if plain or dtype not in (torch.float16, torch.bfloat16) else "gemvp"
