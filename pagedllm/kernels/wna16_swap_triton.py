"""The swap-AB tensor-core kernel for 4-bit weight-only linears of few rows (1-16 a launch), on the
N-major interleaved layout of wna16.py; it must equal `wna16_int4_nk_linear_torch` there. A sibling
of swap_gemm_triton._swap_kernel (same tiles, same split-K workspace and reduce kernel):

      acc [BLOCK_N, 16] += W tile [BLOCK_N, BLOCK_K] (int4 -> x's 16-bit type) @ x.T [BLOCK_K, 16]

The weight tile is read as words [BLOCK_N, BLOCK_K / 8] and turned into 16-bit values without
converting an integer: for a word w and its zero z (per channel or per group, 8 when symmetric)

    fp16 (x fp16 or float32):
      (w      & 0x000F000F) | 0x64006400 = pair (1024 + q0, 1024 + q1)       - (1024 + z)
      (w      & 0x00F000F0) | 0x64006400 = pair (1024 + 16 q2, 1024 + 16 q3) * 1/16 - (64 + z)
      (w >> 8, the same two masks)       -> (q4, q5), (q6, q7)
    bf16 (x bf16; 7 mantissa bits, so every pair is shifted down to bits 0 and 16):
      ((w >> 4 i) & 0x000F000F) | 0x43004300 = pair (128 + q2i, 128 + q2i+1)  - (128 + z)

one `lop3` and one `sub` / `fma` on a 16-bit pair per two inputs (plus 1 or 3 shifts per word),
exact: every value is a small integer. So x enters the MMA as it is (bf16 or fp16; float32 x is
saturated to fp16). Scales, by the group size against BLOCK_K:
  - GROUP_K == 0 (per channel): the finished sum times the row's scale (the epilogue or the reduce);
  - BLOCK_K divides GROUP_K: each K tile's float32 partial times its group's scale (as FP8 does);
  - GROUP_K < BLOCK_K, and the GEMM's tiles (BLOCK_M > 16): the 16-bit values times the scale
    rounded to x's type (`mul` on pairs; one rounding, like a dequantized 16-bit weight, the dense
    path's numerics; in fp16, scales below 6.1e-5 lose bits), the products accumulated in place.

The grid is (row tiles, weight tiles, splits): BLOCK_M rows of x a program (16 for decode batches;
64 / 128 make it a W4A16 GEMM, sm_90 feeding the dequantized weight tile to wgmma from registers),
the row tiles of one weight tile side by side so that it comes from HBM once.

ASM (a constexpr): True on the GPU (`_triton.inline_ptx`: bfloat16 from sm_90 on) makes the pairs
through `tl.inline_asm_elementwise`; False
computes the same values with shifts, masks and float32 math rounded once, which Triton's
interpreter can run (it cannot run PTX, nor bf16 arithmetic). Both give the same 16-bit values bit
for bit (tests/gpu/test_wna16_nk_gpu.py; benchmarks/wna16_bench.py --swap checks it too).

This kernel builds its [BLOCK_N, BLOCK_K] weight tile by joining eight nibble tiles, and Triton
moves the joined tile into the MMA's register layout through shared memory (sm_90 SASS: 128-bit
shared stores, ldmatrix and five barriers a K step). wna16_pairs_triton.py builds the operand where
the MMA reads it instead (`SwapConfig.pairs` sends this wrapper's launch there).

`dequantize_int4_nk_triton` writes the whole weight [N, K] in a 16-bit dtype (the prefill path).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import inline_ptx
from pagedllm.kernels.swap_gemm_triton import FP16_MAX, SWAP_BLOCK_M, SwapConfig, _splitk_reduce_kernel
from pagedllm.kernels.wna16 import group_width

# One word's eight inputs as four 16-bit pairs. $8 the word, $9 the pair's magic + z, $10 (fp16) the
# pair of -(64 + z), $10 / $11 the scale pair (SCALE); outputs $0 .. $7 inputs 0 .. 7 (NIBBLE_OF).
# fp16: 0x6400 is 1024.0, its unit in the last place 1; nibbles 1 and 5 are taken at bits 4 and
# 20 (1024 + 16 q) and brought down by an fma with 1/16 (0x2C00). bf16: 0x4300 is 128.0, ulp 1;
# bf16 has 7 mantissa bits, so every pair is shifted down to bits 0 and 16 first.
_FP16_HEAD = """{
.reg .b32 hi, p0, p1, p2, p3, zz, zm, r16;
mov.b32 zz, {$9, $9};
mov.b32 zm, {$10, $10};
mov.b32 r16, 0x2C002C00;
shr.u32 hi, $8, 8;
lop3.b32 p0, $8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 p1, $8, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 p2, hi, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 p3, hi, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 p0, p0, zz;
fma.rn.f16x2 p1, p1, r16, zm;
sub.f16x2 p2, p2, zz;
fma.rn.f16x2 p3, p3, r16, zm;
"""
_FP16_SCALE = """.reg .b32 ss;
mov.b32 ss, {$11, $11};
mul.f16x2 p0, p0, ss;
mul.f16x2 p1, p1, ss;
mul.f16x2 p2, p2, ss;
mul.f16x2 p3, p3, ss;
"""
_BF16_HEAD = """{
.reg .b32 t1, t2, t3, p0, p1, p2, p3, zz;
mov.b32 zz, {$9, $9};
shr.u32 t1, $8, 4;
shr.u32 t2, $8, 8;
shr.u32 t3, $8, 12;
lop3.b32 p0, $8, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 p1, t1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 p2, t2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 p3, t3, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 p0, p0, zz;
sub.rn.bf16x2 p1, p1, zz;
sub.rn.bf16x2 p2, p2, zz;
sub.rn.bf16x2 p3, p3, zz;
"""
_BF16_SCALE = """.reg .b32 ss;
mov.b32 ss, {$10, $10};
mul.rn.bf16x2 p0, p0, ss;
mul.rn.bf16x2 p1, p1, ss;
mul.rn.bf16x2 p2, p2, ss;
mul.rn.bf16x2 p3, p3, ss;
"""
_TAIL = """mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}"""
_ASM_FP16 = tl.constexpr(_FP16_HEAD + _TAIL)
_ASM_FP16_SCALED = tl.constexpr(_FP16_HEAD + _FP16_SCALE + _TAIL)
_ASM_BF16 = tl.constexpr(_BF16_HEAD + _TAIL)
_ASM_BF16_SCALED = tl.constexpr(_BF16_HEAD + _BF16_SCALE + _TAIL)
_OUT8 = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r")


@triton.jit
def _nibble(w, z, s, NIB: tl.constexpr, SCALE: tl.constexpr):
    # float32 math, one rounding at the end: the packed 16-bit ops' values (q - z is exact, its
    # product with a 16-bit scale exact in float32), and Triton's interpreter has no bf16 arithmetic
    v = ((w >> (4 * NIB)) & 0xF).to(tl.float32) - z.to(tl.float32)
    if SCALE:
        v = v * s.to(tl.float32)
    return v.to(z.dtype)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    # [R, C] x 8 -> [R, 8C]: element (r, 8c + i) is v_i[r, c]. tl.join adds its new axis last,
    # so the outermost join is the fastest-varying index: the tree is in bit-reversed order.
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return v.reshape(v0.shape[0], v0.shape[1] * 8)


@triton.jit
def int4_words_to_16bit(w, z, s, SCALE: tl.constexpr, ASM: tl.constexpr):
    """Words w [R, C] int32 of the N-major layout -> [R, 8C] (q - z), times s when SCALE, in z's
    dtype (float16 or bfloat16; s the same); z and s broadcastable to w, z a small integer."""
    if ASM:
        if z.dtype == tl.float16:
            if SCALE:
                v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                    _ASM_FP16_SCALED, _OUT8 + ",h,h,h", [w, z + 1024.0, -(z + 64.0), s],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=1,
                )  # fmt: skip
            else:
                v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                    _ASM_FP16, _OUT8 + ",h,h", [w, z + 1024.0, -(z + 64.0)],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=1,
                )  # fmt: skip
        else:
            if SCALE:
                v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                    _ASM_BF16_SCALED, _OUT8 + ",h,h", [w, z + 128.0, s],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
                )  # fmt: skip
            else:
                v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                    _ASM_BF16, _OUT8 + ",h", [w, z + 128.0],
                    dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
                )  # fmt: skip
    else:  # the nibbles of inputs 0 .. 7: NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)
        v0 = _nibble(w, z, s, 0, SCALE)
        v1 = _nibble(w, z, s, 4, SCALE)
        v2 = _nibble(w, z, s, 1, SCALE)
        v3 = _nibble(w, z, s, 5, SCALE)
        v4 = _nibble(w, z, s, 2, SCALE)
        v5 = _nibble(w, z, s, 6, SCALE)
        v6 = _nibble(w, z, s, 3, SCALE)
        v7 = _nibble(w, z, s, 7, SCALE)
    return _join8(v0, v1, v2, v3, v4, v5, v6, v7)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # grid (m tiles, n tiles, splits): the row tiles of one weight tile run side by side, so that
    # the weight tile is read from HBM once and from L2 by the others. -> (split, the weight rows
    # (int32 and int64) and their mask, the activation rows and their mask)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.program_id(2), rn, rn < N, rn.to(tl.int64), rm, rm < M


@triton.jit
def _swap_int4_kernel(
    x_ptr,  # [M, K] activations (BLOCK_M rows a program: the grid's first axis)
    w_ptr,  # [N, K/8] int32, N-major interleaved (wna16.py)
    s_ptr,  # [N, G] scales
    z_ptr,  # [N, G] zeros in any float dtype (read when HAS_ZERO)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1) or the float32 workspace [SPLIT_K, M, N]
    M, N, K, K_SPLIT,  # K_SPLIT: the K range of one split, a multiple of BLOCK_K
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr,  # 0: per channel; else the K width of a group (a multiple of 8)
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_BF16: tl.constexpr,  # the weight tile (and x) as bfloat16 (x is bf16); else float16
    ASM: tl.constexpr, FP16_MAX_: tl.constexpr,
):  # fmt: skip
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    W_DTYPE: tl.constexpr = tl.bfloat16 if W_BF16 else tl.float16
    # the group scale multiplies the 16-bit weight tile (one rounding, as a dequantized weight) where a
    # tile spans groups, and in the GEMM's tiles (64+ activation rows), where scaling each K tile's
    # float32 partial would hold a second [BLOCK_N, BLOCK_M] accumulator and an FMA per element
    SCALE_IN_TILE: tl.constexpr = GROUP_K > 0 and (BLOCK_K > GROUP_K or BLOCK_M > 16)
    pid_k, rn, n_mask, rn64, rm, m_mask = _tile(M, N, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rkw = tl.arange(0, BLOCK_KW)
    w_rows = w_ptr + rn64[:, None] * stride_wn  # [BLOCK_N, 1]
    s_rows = s_ptr + rn64 * stride_sn  # [BLOCK_N]
    z_rows = z_ptr + rn64 * stride_sn
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]: x.T's columns
    z_fixed = tl.full([BLOCK_N, 1], 8.0, W_DTYPE)  # symmetric: the zero of 4 bits
    if HAS_ZERO and GROUP_K == 0:
        z_fixed = tl.load(z_rows, mask=n_mask, other=0.0).to(W_DTYPE)[:, None]
    s_unit = tl.full([BLOCK_N, 1], 1.0, W_DTYPE)  # read only when SCALE_IN_TILE
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):  # (the last split may end early)
        kk = k0 + rk
        kw = k0 // 8 + rkw
        if EVEN_K:
            w = tl.load(w_rows + kw[None, :], mask=n_mask[:, None], other=0)
            xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :], other=0.0)
            w_mask = n_mask[:, None]
        else:
            w_mask = n_mask[:, None] & (kw < K // 8)[None, :]
            w = tl.load(w_rows + kw[None, :], mask=w_mask, other=0)
            xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :] & (kk < K)[:, None], other=0.0)
        z = z_fixed
        s = s_unit
        if SCALE_IN_TILE and BLOCK_K > GROUP_K:  # a group per word: [BLOCK_N, BLOCK_KW]
            g = (kw * 8 // GROUP_K)[None, :]
            s = tl.load(s_rows[:, None] + g, mask=w_mask, other=0.0).to(W_DTYPE)
            if HAS_ZERO:
                z = tl.load(z_rows[:, None] + g, mask=w_mask, other=0.0).to(W_DTYPE)
        elif GROUP_K > 0:  # one group for the tile
            if SCALE_IN_TILE:
                s = tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0).to(W_DTYPE)[:, None]
            if HAS_ZERO:
                z = tl.load(z_rows + k0 // GROUP_K, mask=n_mask, other=0.0).to(W_DTYPE)[:, None]
        wt = int4_words_to_16bit(w, z, s, SCALE_IN_TILE, ASM)
        if xt.dtype != W_DTYPE:  # float32 x: fp16 operands, saturated
            xt = tl.clamp(xt.to(tl.float32), -FP16_MAX_, FP16_MAX_).to(tl.float16)
        if GROUP_K > 0 and not SCALE_IN_TILE:
            part = tl.dot(wt, xt)
            acc += part * tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        else:
            acc = tl.dot(wt, xt, acc)
    _int4_epilogue(acc, s_rows, b_ptr, out_ptr, rm, rn, n_mask, m_mask, pid_k, M, N, stride_om, GROUP_K, HAS_BIAS,
                   SPLIT_K)  # fmt: skip


@triton.jit
def _int4_epilogue(acc, s_rows, b_ptr, out_ptr, rm, rn, n_mask, m_mask, pid_k, M, N, stride_om,
                   GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    # one split: the per-channel scale and the bias, stored; several: the float32 partial to the
    # workspace (the reduce kernel scales and adds the bias)
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        if GROUP_K == 0:
            acc = acc * tl.load(s_rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + rm[None, :] * stride_om + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        ws = out_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None]
        tl.store(ws, acc, mask=out_mask)


@triton.jit
def _dequant_int4_nk_kernel(
    w_ptr, s_ptr, z_ptr,  # [N, K/8] int32, [N, G] scales, [N, G] zeros (HAS_ZERO)
    out_ptr,  # [N, K] 16-bit
    N, K, stride_wn, stride_sn, stride_on,
    GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    # (q - z) exactly in fp16 by the same helper, then times the scale in float32: equal to
    # dequantize_int4_nk_torch bit for bit
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kw = tl.program_id(1) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn64 = rn.to(tl.int64)
    n_mask = rn < N
    w_mask = n_mask[:, None] & (kw < K // 8)[None, :]
    w = tl.load(w_ptr + rn64[:, None] * stride_wn + kw[None, :], mask=w_mask, other=0)
    g = tl.zeros([BLOCK_K], dtype=tl.int32) if GROUP_K == 0 else kk // GROUP_K
    k_mask = kk < K
    sz_off = rn64[:, None] * stride_sn + g[None, :]
    sz_mask = n_mask[:, None] & k_mask[None, :]
    z = tl.full([BLOCK_N, 1], 8.0, tl.float16)
    v = int4_words_to_16bit(w, z, z, False, ASM)
    v = v.to(tl.float32)
    if HAS_ZERO:
        v = v + 8.0 - tl.load(z_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
    v = v * tl.load(s_ptr + sz_off, mask=sz_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn64[:, None] * stride_on + kk[None, :], v.to(out_ptr.dtype.element_ty), mask=sz_mask)


def default_config(m: int, n: int, k: int, group_k: int) -> SwapConfig:
    """Up to SWAP_BLOCK_M rows: 64-wide weight tiles (the H200's wgmma), 128-wide K steps. More
    rows (the GEMM): 128-wide weight tiles against 64 or 128 activation rows a program (one or two
    warpgroups; sm_90 compiles them to wgmma with the dequantized weight as the register operand,
    nothing spilled), 64-wide K steps. Split-K: _split_k. A guess fitted to nothing
    yet: benchmarks/wna16_bench.py --swap sweeps it."""
    if m <= SWAP_BLOCK_M:
        block_m, block_n, block_k, warps = SWAP_BLOCK_M, 64, 128, 4
    else:
        block_m = 64 if m <= 64 else 128
        block_n, block_k, warps = 128, 64, 4 if block_m == 64 else 8
    split_k = _split_k(m, n, k, block_m, block_n, block_k)
    return SwapConfig(block_n, block_k, split_k, num_warps=warps, num_stages=4 if split_k == 1 and m <= SWAP_BLOCK_M
                      else 3, block_m=block_m)


def _split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, max_programs: int = 264) -> int:
    """Splits of K by powers of two while the programs stay within max_programs (by default about
    two per SM of an H200's 132) and each split keeps four K steps."""
    tiles = -(-n // block_n) * -(-m // block_m)
    split_k = 1
    while 2 * split_k * tiles <= max_programs and split_k < 8 and k >= 4 * block_k * (2 * split_k):
        split_k *= 2
    return split_k


def _k_splits(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(inputs a split, whole K steps; splits) for `split_k` asked over k inputs: no empty split."""
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def _sum_splits(ws: torch.Tensor | None, scales: torch.Tensor, scale_stride_n: int, bias: torch.Tensor | None,
                out: torch.Tensor, group_k: int) -> None:
    """Adds the float32 partials ws [SPLIT_K, M, N] into out (nothing when ws is None: one split),
    with the per-channel scale (scales' element of column n at n * scale_stride_n) and the bias."""
    if ws is None:
        return
    m, n = out.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
        ws, scales, bias if bias is not None else scales, out, m, n, scale_stride_n, out.stride(0),
        SPLIT_K=ws.shape[0], SCALED=group_k == 0, GROUP_K=0, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip


def wna16_swap_gemm(
    x: torch.Tensor,  # [M, K]: cfg.block_m rows a program
    qweight: torch.Tensor,  # [N, K/8] int32, N-major interleaved
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None,  # [N, G] or None (symmetric: 8)
    bias: torch.Tensor | None = None,  # [N]
    config: SwapConfig | None = None,
    asm: bool | None = None,  # None: the PTX path on a GPU, the plain one under the interpreter
    pairs: bool = False,  # without a config: default_config's tiles through the pairs kernel
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n, kw = qweight.shape
    assert kw * 8 == k and qweight.stride(1) == 1 and scales.shape[0] == n and scales.stride(1) == 1
    assert zeros is None or (zeros.shape == scales.shape and zeros.stride() == scales.stride())
    assert not (config and config.reduce != "kernel"), "the int4 swap kernel sums its splits with the reduce kernel"
    if x.stride(1) != 1:
        x = x.contiguous()
    group_k = group_width(k, scales.shape[1], 8)
    cfg = config or dataclasses.replace(default_config(m, n, k, group_k), pairs=pairs)
    block_k = cfg.block_k
    assert block_k % 8 == 0 and (group_k == 0 or group_k % block_k == 0 or block_k % group_k == 0)
    assert not cfg.pairs or block_k % 64 == 0, "the pairs kernel's dots take block_k / 4 >= 16 columns"
    if asm is None:
        asm = inline_ptx(x.device, x.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_split, split_k = _k_splits(k, cfg.split_k, block_k)
    z = zeros if zeros is not None else scales  # an unused pointer when symmetric
    b = bias if bias is not None else scales  # likewise without a bias
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else None
    if cfg.pairs:
        from pagedllm.kernels.wna16_pairs_triton import _swap_int4_pairs_kernel as kernel
    else:
        kernel = _swap_int4_kernel
    kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)](
        x, qweight, scales, z, b, out if ws is None else ws, m, n, k, k_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_K=group_k, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        EVEN_K=k_split * split_k == k, SPLIT_K=split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, W_BF16=x.dtype == torch.bfloat16, ASM=asm, FP16_MAX_=FP16_MAX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _sum_splits(ws, scales, scales.stride(0), bias, out, group_k)
    return out


def dequantize_int4_nk_triton(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, dtype: torch.dtype, asm: bool | None = None
) -> torch.Tensor:
    """The real weight [N, K] in `dtype` (equal to dequantize_int4_nk_torch)."""
    n, kw = qweight.shape
    k = kw * 8
    group_k = group_width(k, scales.shape[1], 8)
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 256
    _dequant_int4_nk_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if zeros is not None else scales, out, n, k,
        qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP_K=group_k, HAS_ZERO=zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        ASM=inline_ptx(qweight.device, dtype) if asm is None else asm, num_warps=4,
    )  # fmt: skip
    return out
