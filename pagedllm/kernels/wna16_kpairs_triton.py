"""A tensor-core W4A16 GEMM on the K-packed layout of wna16.py (`kpairs`), so that the default
4-bit layout, whose one-row GEMV is the fastest (gemvp), also has a GEMM for large batches
without dequantizing the weight to a scratch matrix; must equal `wna16_linear_torch` (bits 4).

Swap-AB, as wna16_swap_triton's kernels: acc [BLOCK_N, BLOCK_M] += W tile (the MMA's register
operand) @ x.T tile (shared memory). The weight operand is built where the MMA reads it: a K step
of BLOCK_K inputs is four dots, dot i over nibbles i and i + 4 of the step's words (inputs 8j + i
and 8j + i + 4 of word j). Each word is loaded into two adjacent columns, and one shift and one
lop3 with the magic number make the pair of them one 16-bit pair register (the pairs kernel's
`_PAIR_ASM`): every op from the load to the MMA is elementwise, so Triton needs no layout
conversion (sm_90: no shared-memory round trip; tests/unit/test_wna16_kpairs_interpret.py).

So that each dot reads x's rows contiguously, x is permuted first (`kpairs_permutation`, one
gather a call): within each K step, x'[k0 + i * BLOCK_K / 4 + 2j + h] = x[k0 + 8j + i + 4h]. K is
padded to whole steps (x' zero there).

Scales: a group per K step (GROUP_K a multiple of BLOCK_K) or per word (GROUP_K < BLOCK_K) go into
the tile, rounded to x's type once with the weight (the GEMM tiles' numerics of the swap kernels);
per channel into the epilogue or the split-K reduce.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.kernels.swap_gemm_triton import FP16_MAX, SwapConfig, _splitk_reduce_kernel
from pagedllm.kernels.wna16_swap_triton import _int4_epilogue, _pairs_operand, _split_k, _tile


@triton.jit
def _kpairs_kernel(
    x_ptr,  # [M, KP] activations, permuted (kpairs_permutation), KP = K padded to whole K steps
    w_ptr,  # [K/8, N] int32, K-packed (wna16.py)
    s_ptr,  # [G, N] scales
    z_ptr,  # [G, N] zeros in any float dtype (read when HAS_ZERO)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1) or the float32 workspace [SPLIT_K, M, N]
    M, N, K, KP, K_SPLIT,  # K: the weight's inputs; KP: x''s (K padded); K_SPLIT: a split's range, whole steps
    stride_xm, stride_wk, stride_sg, stride_om,
    GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_BF16: tl.constexpr, ASM: tl.constexpr, FP16_MAX_: tl.constexpr,
):  # fmt: skip
    BLOCK_C: tl.constexpr = BLOCK_K // 4  # a dot's columns: two a word
    W_DTYPE: tl.constexpr = tl.bfloat16 if W_BF16 else tl.float16
    MAGIC: tl.constexpr = 128.0 if W_BF16 else 1024.0
    pid_k, rn, n_mask, rn64, rm, m_mask = _tile(M, N, BLOCK_M, BLOCK_N)
    rc = tl.arange(0, BLOCK_C)
    hi = (rc % 2)[None, :]
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    zc = tl.full([BLOCK_N, BLOCK_C], MAGIC + 8.0, W_DTYPE)  # symmetric: the zero of 4 bits
    if HAS_ZERO and GROUP_K == 0:
        zc = tl.broadcast_to((tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32) + MAGIC).to(W_DTYPE)[:, None],
                             [BLOCK_N, BLOCK_C])  # fmt: skip
    s = tl.full([BLOCK_N, BLOCK_C], 1.0, W_DTYPE)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, KP), BLOCK_K):  # (the last split may end early)
        kw = k0 // 8 + rc // 2  # the word a column reads: columns 2p and 2p + 1 read word p
        w_mask = n_mask[:, None] & (kw < K // 8)[None, :]
        w = tl.load(w_ptr + kw.to(tl.int64)[None, :] * stride_wk + rn[:, None], mask=w_mask, other=0)
        if GROUP_K > 0:
            if GROUP_K % BLOCK_K == 0:  # one group for the step
                g_off = (k0 // GROUP_K) * stride_sg + rn
                s = tl.broadcast_to(tl.load(s_ptr + g_off, mask=n_mask, other=0.0).to(W_DTYPE)[:, None],
                                    [BLOCK_N, BLOCK_C])  # fmt: skip
                if HAS_ZERO:
                    zc = tl.broadcast_to((tl.load(z_ptr + g_off, mask=n_mask, other=0.0).to(tl.float32)
                                          + MAGIC).to(W_DTYPE)[:, None], [BLOCK_N, BLOCK_C])  # fmt: skip
            else:  # a group per word (a word's eight inputs share one)
                g_off = (kw * 8 // GROUP_K).to(tl.int64)[None, :] * stride_sg + rn[:, None]
                s = tl.load(s_ptr + g_off, mask=w_mask, other=0.0).to(W_DTYPE)
                if HAS_ZERO:
                    zc = (tl.load(z_ptr + g_off, mask=w_mask, other=0.0).to(tl.float32) + MAGIC).to(W_DTYPE)
        for i in tl.static_range(4):
            xt = tl.load(x_cols + (k0 + i * BLOCK_C + rc)[:, None], mask=m_mask[None, :], other=0.0)
            if xt.dtype != W_DTYPE:  # float32 x: fp16 operands, saturated
                xt = tl.clamp(xt.to(tl.float32), -FP16_MAX_, FP16_MAX_).to(tl.float16)
            acc = tl.dot(_pairs_operand(w, zc, s, hi, i, W_BF16, ASM), xt, acc)
    _int4_epilogue(acc, s_ptr + rn64, b_ptr, out_ptr, rm, rn, n_mask, m_mask, pid_k, M, N, stride_om, GROUP_K,
                   HAS_BIAS, SPLIT_K)  # fmt: skip


@functools.cache
def kpairs_permutation(k_padded: int, block_k: int, device: torch.device) -> torch.Tensor:
    """Indices p [k_padded] with x' = x[:, p]: within each K step of block_k inputs, position
    i * block_k / 4 + 2j + h takes input 8j + i + 4h (i < 4, j < block_k / 8, h < 2)."""
    # made on the device (no host copy: a first call may come inside a CUDA graph's capture)
    i, j, h = torch.meshgrid(torch.arange(4, device=device), torch.arange(block_k // 8, device=device),
                             torch.arange(2, device=device), indexing="ij")  # fmt: skip
    step = (8 * j + i + 4 * h).reshape(-1)  # position i * block_k / 4 + 2j + h, in that order
    return (torch.arange(0, k_padded, block_k, device=device)[:, None] + step[None, :]).reshape(-1)


def default_config(m: int, n: int, k: int) -> SwapConfig:
    """64 or 128 activation rows a program (4 / 8 warps), 128-wide weight tiles, K steps of 128;
    split-K as the swap kernels' GEMM tiles. A guess fitted to nothing yet: wna16_bench.py sweeps it."""
    block_m = 64 if m <= 64 else 128
    return SwapConfig(128, 128, _split_k(m, n, k, block_m, 128, 128), num_warps=4 if block_m == 64 else 8,
                      num_stages=3, block_m=block_m, pairs=True)


def wna16_kpairs_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # [K/8, N] int32, K-packed 4-bit
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N] or None (symmetric: 8)
    bias: torch.Tensor | None = None,  # [N]
    config: SwapConfig | None = None,
    asm: bool | None = None,  # None: the PTX pairs on a GPU, the plain ops under the interpreter
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    kw, n = qweight.shape
    g = scales.shape[0]
    assert kw * 8 == k and qweight.stride(1) == 1 and scales.shape[1] == n and scales.stride(1) == 1
    assert zeros is None or (zeros.shape == scales.shape and zeros.stride() == scales.stride())
    group_k = 0 if g == 1 else k // g
    assert group_k % 8 == 0 and group_k * g in (0, k)
    cfg = config or default_config(m, n, k)
    block_k = cfg.block_k
    assert block_k % 64 == 0 and cfg.reduce == "kernel", "dots of block_k / 4 >= 16 columns; the reduce kernel"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_padded = triton.cdiv(k, block_k) * block_k
    xp = x if k_padded == k else torch.nn.functional.pad(x, (0, k_padded - k))
    xp = xp.index_select(1, kpairs_permutation(k_padded, block_k, x.device))
    k_split = triton.cdiv(triton.cdiv(k_padded, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(k_padded, k_split)  # no empty split
    z = zeros if zeros is not None else scales  # an unused pointer when symmetric
    b = bias if bias is not None else scales  # likewise without a bias
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else None
    _kpairs_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)](
        xp, qweight, scales, z, b, out if ws is None else ws, m, n, k, k_padded, k_split,
        xp.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_K=group_k, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, SPLIT_K=split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, W_BF16=x.dtype == torch.bfloat16,
        ASM=x.is_cuda if asm is None else asm, FP16_MAX_=FP16_MAX, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if ws is not None:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            ws, scales, b, out, m, n, 1, out.stride(0),
            SPLIT_K=split_k, SCALED=group_k == 0, GROUP_K=0, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
