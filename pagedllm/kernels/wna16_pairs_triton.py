"""4-bit tensor-core GEMMs whose weight operand is built where the MMA reads it: the construction
shared by the N-major layout's pairs kernel here (`SwapConfig.pairs`, launched by
wna16_swap_triton.wna16_swap_gemm; PAGEDLLM_WNA16_GEMM=pairs) and the K-packed layout's kpairs GEMM
(wna16_kpairs_triton.py); each must equal its layout's torch reference.

The construction: a K step of BLOCK_K inputs is four dots, dot i over nibbles i and i + 4 of the
step's words. Each word is loaded into two adjacent columns, and one shift and one lop3 with the
magic number make the pair of them one 16-bit pair register (`_PAIR_ASM`): every op from the load
to the MMA is elementwise, so Triton needs no layout conversion (sm_90: no shared-memory round
trip, wgmma reads the operand from registers; tests/unit/test_wna16_*_interpret.py check the SASS).
Which inputs a dot's columns hold depends on the layout:

  N-major (wna16.py's interleaved words): nibbles i and i + 4 of word j are inputs 8j + 2i and
  8j + 2i + 1, so x.T's rows are gathered in 4-byte pairs.
  K-packed (`kpairs`): nibbles i and i + 4 of word j are inputs 8j + i and 8j + i + 4
  (wna16_kpairs_triton.py says how x meets them).

Scales: a group per K step or per word go into the tile, rounded to x's type once with the weight
(the swap kernels' GEMM tiles' numerics); per channel into the epilogue or the split-K reduce.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kernels.wna16_swap_triton import _int4_epilogue, _tile


def _pair_asm(nib: int, bf16: bool) -> tl.constexpr:
    # The pairs kernel's operand: two elements (the same word twice) -> one 16-bit pair, nibble nib
    # low and nibble nib + 4 high, minus (magic + z) ($3), times the scale pair ($4)
    magic, sub, mul = ("0x43004300", "sub.rn.bf16x2", "mul.rn.bf16x2") if bf16 else ("0x64006400", "sub.f16x2",
                                                                                     "mul.f16x2")
    return tl.constexpr(f"""{{
.reg .b32 t;
shr.u32 t, $1, {4 * nib};
lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;
{sub} t, t, $3;
{mul} $0, t, $4;
}}""")


_PAIR_ASM = tl.constexpr(tuple(_pair_asm(i, bf16).value for bf16 in (False, True) for i in range(4)))


@triton.jit
def _pairs_operand(w, zc, s, hi, NIB: tl.constexpr, W_BF16: tl.constexpr, ASM: tl.constexpr):
    """[R, C] 16-bit values from words w [R, C] whose columns 2p and 2p + 1 hold the same word:
    column 2p the word's nibble NIB, 2p + 1 its nibble NIB + 4 (the inputs they are: the layout's,
    module docstring), minus the zero, times s. zc: the magic number plus the zero (128 + z
    bf16, 1024 + z fp16), s the scale, both in the 16-bit type and broadcast to w; hi [1, C]: the
    column's parity (read by the interpreter's path only)."""
    if ASM:  # one shift, one lop3, sub and mul on the pair: the two columns of a word are one register
        v = tl.inline_asm_elementwise(_PAIR_ASM[4 * W_BF16 + NIB], "=r,r,r,r,r", [w, zc, s], dtype=zc.dtype,
                                      is_pure=True, pack=2)  # fmt: skip
    else:
        v = _pairs_plain(w, zc, s, 4 * NIB + 16 * hi, W_BF16)
    return v


@triton.jit
def _pairs_plain(w, zc, s, shift, W_BF16: tl.constexpr):
    """The pairs' values by plain ops (the interpreter's path): float32 math rounded once, the pair
    ops' values (q - z exact, its product with s exact in float32); shift: each element's nibble."""
    magic = 128.0 if W_BF16 else 1024.0
    q = ((w >> shift) & 0xF).to(tl.float32)
    return ((q - (zc.to(tl.float32) - magic)) * s.to(tl.float32)).to(zc.dtype)


@triton.jit
def _channel_zeros(z_ptr, rn64, n_mask, stride_n, HAS_ZERO: tl.constexpr, GROUP_K: tl.constexpr,
                   MAGIC: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    # the pairs' magic + zero [BLOCK_N, BLOCK_C] before the loop: the zero of 4 bits (symmetric), or
    # per channel the row's; group zeros are read by _group_scales
    zc = tl.full([rn64.shape[0], BLOCK_C], MAGIC + 8.0, W_DTYPE)
    if HAS_ZERO and GROUP_K == 0:
        z = tl.load(z_ptr + rn64 * stride_n, mask=n_mask, other=0.0).to(tl.float32)
        zc = tl.broadcast_to((z + MAGIC).to(W_DTYPE)[:, None], [rn64.shape[0], BLOCK_C])
    return zc


@triton.jit
def _group_scales(s_ptr, z_ptr, rn64, n_mask, w_mask, k0, kw, s, zc, stride_n, stride_g, GROUP_K: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr, MAGIC: tl.constexpr, W_DTYPE: tl.constexpr):  # fmt: skip
    # (s, zc) of a K step whose columns read words kw: scale (group g of row n at s_ptr + n stride_n
    # + g stride_g) and magic + zero in the 16-bit type, broadcast to the operand; unchanged per
    # channel (GROUP_K == 0: the epilogue scales)
    if GROUP_K > 0:
        if GROUP_K % BLOCK_K == 0:  # one group for the step
            off = rn64 * stride_n + (k0 // GROUP_K) * stride_g
            s = tl.broadcast_to(tl.load(s_ptr + off, mask=n_mask, other=0.0).to(W_DTYPE)[:, None], s.shape)
            if HAS_ZERO:
                z = tl.load(z_ptr + off, mask=n_mask, other=0.0).to(tl.float32)
                zc = tl.broadcast_to((z + MAGIC).to(W_DTYPE)[:, None], zc.shape)
        else:  # a group per word (a word's eight inputs share one)
            off = rn64[:, None] * stride_n + (kw * 8 // GROUP_K).to(tl.int64)[None, :] * stride_g
            s = tl.load(s_ptr + off, mask=w_mask, other=0.0).to(W_DTYPE)
            if HAS_ZERO:
                zc = (tl.load(z_ptr + off, mask=w_mask, other=0.0).to(tl.float32) + MAGIC).to(W_DTYPE)
    return s, zc


@triton.jit
def _swap_int4_pairs_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,  # as _swap_int4_kernel's
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_BF16: tl.constexpr, ASM: tl.constexpr, FP16_MAX_: tl.constexpr,
):  # fmt: skip
    """_swap_int4_kernel's product with the weight operand built where the MMA reads it: a K step
    of BLOCK_K inputs (BLOCK_K / 8 words a row) is four dots, dot i over the inputs 8j + 2i and
    8j + 2i + 1 of its words j. Each word is loaded into two adjacent columns, so that the pair a
    word gives (nibbles i and i + 4) is one register of the operand and every op from the load to
    the MMA is elementwise: the operand needs no layout conversion (sm_90: no shared-memory round
    trip, wgmma reads it from registers). x.T's rows are gathered in the same input order. Group
    scales go into the tile (GROUP_K > 0), per-channel ones into the epilogue or the reduce."""
    BLOCK_C: tl.constexpr = BLOCK_K // 4  # an operand's columns: two a word
    W_DTYPE: tl.constexpr = tl.bfloat16 if W_BF16 else tl.float16
    MAGIC: tl.constexpr = 128.0 if W_BF16 else 1024.0
    pid_k, rn, n_mask, rn64, rm, m_mask = _tile(M, N, BLOCK_M, BLOCK_N)
    rc = tl.arange(0, BLOCK_C)
    word = rc // 2  # the word a column reads
    hi = (rc % 2)[None, :]
    w_rows = w_ptr + rn64[:, None] * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    zc = _channel_zeros(z_ptr, rn64, n_mask, stride_sn, HAS_ZERO, GROUP_K, MAGIC, W_DTYPE, BLOCK_C)
    s = tl.full([BLOCK_N, BLOCK_C], 1.0, W_DTYPE)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):  # (the last split may end early)
        kw = k0 // 8 + word  # [BLOCK_C]
        if EVEN_K:
            w_mask = n_mask[:, None]
        else:
            w_mask = n_mask[:, None] & (kw < K // 8)[None, :]
        w = tl.load(w_rows + kw[None, :], mask=w_mask, other=0)
        s, zc = _group_scales(s_ptr, z_ptr, rn64, n_mask, w_mask, k0, kw, s, zc, stride_sn, 1, GROUP_K, BLOCK_K,
                              HAS_ZERO, MAGIC, W_DTYPE)  # fmt: skip
        for i in tl.static_range(4):
            kk = 8 * kw + 2 * i + (rc % 2)  # the inputs of dot i's columns
            if EVEN_K:
                xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :], other=0.0)
            else:
                xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :] & (kk < K)[:, None], other=0.0)
            if xt.dtype != W_DTYPE:  # float32 x: fp16 operands, saturated
                xt = tl.clamp(xt.to(tl.float32), -FP16_MAX_, FP16_MAX_).to(tl.float16)
            acc = tl.dot(_pairs_operand(w, zc, s, hi, i, W_BF16, ASM), xt, acc)
    _int4_epilogue(acc, s_ptr + rn64 * stride_sn, b_ptr, out_ptr, rm, rn, n_mask, m_mask, pid_k, M, N, stride_om,
                   GROUP_K, HAS_BIAS, SPLIT_K)  # fmt: skip
