"""The one-row 4-bit GEMV on the N-major interleaved layout of wna16.py (`gemvn`), so that the
layout the swap-AB kernel and its GEMM read (PAGEDLLM_WNA16_SWAP=1) keeps a CUDA-core GEMV for
batch 1; must equal `wna16_int4_nk_linear_torch` there.

A program owns BLOCK_N output rows and a K range; its tile is [BLOCK_KW, BLOCK_N] words, each
weight row's words contiguous (coalesced along K). The layout puts inputs 2i and 2i + 1 of a word in nibbles i
and i + 4, so the packed 16-bit arithmetic of the K-packed gemvp (wna16_words_triton._GEMVP_ASM_*:
one lop3 makes the pair MAGIC + q of two nibbles) meets the activations in their natural pairs:
(x0, x1), (x2, x3), (x4, x5), (x6, x7) are the four int32 words of x at the word's eight inputs,
read as they are -- no repacking of x. The products are summed per word in 16-bit pairs, then in
float32 (as gemvp rounds), times the group's scale; the rows' sums are reduced over the K tile once,
at the end. Split-K: the splits' partials added by the last of them (wna16_gemv_triton._gemv_store,
whatever PAGEDLLM_SWAP_LAST_REDUCE says).

ASM False (the interpreter; bfloat16 before sm_90: `_triton.inline_ptx`) runs the PTX's steps in Triton
ops (wna16_words_triton._gemvp_word_emulated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import inline_ptx
from pagedllm.kernels.counters import counters
from pagedllm.kernels.wna16 import group_width
from pagedllm.kernels.wna16_gemv_triton import _gemv_store, _rows_as_int32_pairs
from pagedllm.kernels.wna16_triton import gemv_prefetch
from pagedllm.kernels.wna16_words_triton import gemvp_word_sums

# rows the dispatcher sends here (wna16.wna16_int4_nk_linear); more go to the swap-AB kernel, which
# reads the weight once for up to 16 rows
GEMVN_MAX_ROWS = 1


@triton.jit
def _wna16_gemvn_kernel(
    x_ptr,  # [M, K] activations, float16 or bfloat16 (rows 4-byte aligned: read as int32 pairs)
    w_ptr,  # [N, K/8] int32, N-major interleaved (wna16.py)
    s_ptr,  # [N, G] scales
    z_ptr,  # [N, G] zeros (read when HAS_ZERO)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N]
    ws_ptr,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1)
    count_ptr,  # int32 counters, zero between calls (SPLIT_K > 1: one per row and column block)
    M, N, KW, KW_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr,  # 0: one scale per row (per channel)
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, ASM: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # the next tile's words loaded first (wna16_triton.gemv_prefetch)
):  # fmt: skip
    # a K tile inside one group (tiles start at multiples of BLOCK_KW words: the splits are too)
    ONE_GROUP: tl.constexpr = GROUP_K > 0 and GROUP_K % (BLOCK_KW * 8) == 0
    act: tl.constexpr = x_ptr.dtype.element_ty
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    ri = tl.arange(0, BLOCK_KW)
    x_words = (x_ptr + m * stride_xm).to(tl.pointer_type(tl.int32))
    kw_lo = pid_k * KW_PER_SPLIT
    kw_hi = tl.minimum(kw_lo + KW_PER_SPLIT, KW)
    # tiles [BLOCK_KW, BLOCK_N]: a column is a row of W, its words contiguous; x's words [BLOCK_KW, 1]
    # broadcast along the rows (the K-packed gemvp's arrangement, whose layouts need no conversion)
    if GROUP_K == 0:
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn64 * stride_sn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            zero = tl.full([1, BLOCK_N], 8.0, tl.float32)
    acc = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + rn64[None, :] * stride_wn
    if PREFETCH:  # the first tile's words, before the loop
        w_next = tl.load(w_rows + (kw_lo + ri)[:, None], mask=((kw_lo + ri) < kw_hi)[:, None] & n_mask[None, :],
                         other=0)
    for kw0 in range(kw_lo, kw_hi, BLOCK_KW):
        cols = kw0 + ri
        if EVEN:
            c_mask = ri < BLOCK_KW
        else:
            c_mask = cols < kw_hi
        mask = c_mask[:, None] & n_mask[None, :]
        if PREFETCH:  # this tile's words came with the last iteration; the next tile's go out now
            w = w_next
            w_next = tl.load(w_rows + (cols + BLOCK_KW)[:, None],
                             mask=((cols + BLOCK_KW) < kw_hi)[:, None] & n_mask[None, :], other=0)
        else:
            w = tl.load(w_rows + cols[:, None], mask=mask, other=0)
        if GROUP_K > 0:
            if ONE_GROUP:  # the tile's inputs lie in one group: a scale (and zero) a column
                s_off = rn64[None, :] * stride_sn + kw0 * 8 // GROUP_K
                s_mask = n_mask[None, :]
            else:
                s_off = rn64[None, :] * stride_sn + (cols * 8 // GROUP_K)[:, None]
                s_mask = mask
            if HAS_ZERO:
                zero = tl.load(z_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
            else:
                zero = tl.full([1, BLOCK_N], 8.0, tl.float32)
        x01 = tl.load(x_words + cols * 4, mask=c_mask, other=0)[:, None]  # (x0, x1) of each word
        x23 = tl.load(x_words + cols * 4 + 1, mask=c_mask, other=0)[:, None]
        x45 = tl.load(x_words + cols * 4 + 2, mask=c_mask, other=0)[:, None]
        x67 = tl.load(x_words + cols * 4 + 3, mask=c_mask, other=0)[:, None]
        wsum = gemvp_word_sums(w, x01, x23, x45, x67, zero, act, ASM)
        if GROUP_K > 0:
            acc += wsum * tl.load(s_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        else:
            acc += wsum
    y = tl.sum(acc, axis=0)
    if GROUP_K == 0:
        y = y * tl.load(s_ptr + rn64 * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        if pid_k == 0:
            y = y + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    _gemv_store(y, out_ptr, ws_ptr, count_ptr, m, rn, n_mask, stride_om, M, N, SPLIT_K, True)


def gemvn_config(n: int, k: int, group_k: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_KW, split_k, num_warps): 128 rows of 16 words a tile (at most one group: one
    scale a column, no gather; fewer words for groups under 128), 4 warps; split-K by powers of two
    while the programs stay within about two per SM of an H200 (132) and each split keeps two
    tiles. Chosen by sm_90 instruction counts (benchmarks/sass_counts.py: bf16 23.8, fp16 21.9 a
    word at groups of 128, against the K-packed gemvp's 25.8 / 23.4), not yet timed
    (benchmarks/wna16_bench.py --swap times it at one row)."""
    block_n, block_kw, warps = 128, 16 if group_k == 0 else max(1, min(16, group_k // 8)), 4
    tiles = -(-n // block_n)
    split_k = 1
    while 2 * split_k * tiles <= 264 and split_k < 8 and k // 8 >= 2 * block_kw * (2 * split_k):
        split_k *= 2
    return block_n, block_kw, split_k, warps


def wna16_gemvn(
    x: torch.Tensor,  # [M, K] float16 / bfloat16, rows 4-byte aligned
    qweight: torch.Tensor,  # [N, K/8] int32, N-major interleaved
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] or None (symmetric: 8)
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,  # gemvn_config's fields
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n, kw = qweight.shape
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the gemvn kernel takes 16-bit activations, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not _rows_as_int32_pairs(x):
        x = x.contiguous()
    assert kw * 8 == k and qweight.stride(1) == 1 and scales.shape[0] == n and scales.stride(1) == 1
    assert zeros is None or zeros.stride() == scales.stride()
    group_k = group_width(k, scales.shape[1], 8)
    block_n, block_kw, split_k, num_warps = config or gemvn_config(n, k, group_k)
    kw_per_split = triton.cdiv(triton.cdiv(kw, split_k), block_kw) * block_kw
    split_k = triton.cdiv(kw, kw_per_split)
    n_blocks = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    count = counters(x.device, m * n_blocks) if split_k > 1 else qweight
    _wna16_gemvn_kernel[(m, n_blocks, split_k)](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out, ws,
        count, m, n, kw, kw_per_split, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_K=group_k, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, SPLIT_K=split_k,
        EVEN=kw_per_split * split_k == kw, BLOCK_N=block_n, BLOCK_KW=block_kw,
        ASM=inline_ptx(x.device, x.dtype), PREFETCH=gemv_prefetch() in (None, 1), num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    return out
