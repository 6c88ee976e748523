"""One 4-bit word against its eight activations in packed 16-bit arithmetic: the inner step that the
few-row GEMVs gemvp (K-packed, wna16_gemv_triton.py) and gemvn (N-major, wna16_gemvn_triton.py) share.
`gemvp_word_sums` runs it as inline PTX (_GEMVP_ASM_F16 / _BF16) or, ASM False (the interpreter;
bfloat16 before sm_90), as the same steps in Triton ops (`_gemvp_word_emulated`)."""

from __future__ import annotations

import triton
import triton.language as tl

# One word of 4-bit values against its eight activations, in packed 16-bit arithmetic (inline
# PTX, sm_90): $1 the word (inputs k0..k7 at nibbles 0..7), $2..$5 the activation pairs (x0, x4),
# (x1, x5), (x2, x6), (x3, x7) as two 16-bit floats in one register, $6 / $7 the offset pairs
# (MAGIC + zero) and (fp16) -(64 + zero); $0 the float32 sum of the eight products.
# lop3 (w & mask) | magic reads two nibbles of a word -- k_i in the low half, k_i+4 in the high --
# as the floats MAGIC + q; fp16 (10 mantissa bits) also takes bits 4-7 as 1024 + 16 q, so one
# shift serves four nibbles; bf16 (7 bits) shifts for each.
_GEMVP_ASM_F16 = tl.constexpr("""{
.reg .b32 t, q0, q1, q2, q3, a, c;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
lop3.b32 q0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q1, $1, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, $1, 8;
lop3.b32 q2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q3, t, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 c, 0x2C002C00;
sub.f16x2 q0, q0, $6;
fma.rn.f16x2 q1, q1, c, $7;
sub.f16x2 q2, q2, $6;
fma.rn.f16x2 q3, q3, c, $7;
mul.rn.f16x2 a, q0, $2;
fma.rn.f16x2 a, q1, $3, a;
fma.rn.f16x2 a, q2, $4, a;
fma.rn.f16x2 a, q3, $5, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")
_GEMVP_ASM_BF16 = tl.constexpr("""{
.reg .b32 t, q0, q1, q2, q3, a, blo, bhi;
.reg .f32 flo, fhi;
lop3.b32 q0, $1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, $1, 4;
lop3.b32 q1, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, $1, 8;
lop3.b32 q2, t, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t, $1, 12;
lop3.b32 q3, t, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 q0, q0, $6;
sub.rn.bf16x2 q1, q1, $6;
sub.rn.bf16x2 q2, q2, $6;
sub.rn.bf16x2 q3, q3, $6;
mul.rn.bf16x2 a, q0, $2;
fma.rn.bf16x2 a, q1, $3, a;
fma.rn.bf16x2 a, q2, $4, a;
fma.rn.bf16x2 a, q3, $5, a;
shl.b32 blo, a, 16;
and.b32 bhi, a, 0xFFFF0000;
mov.b32 flo, blo;
mov.b32 fhi, bhi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _pair_bits(lo, hi):
    """Two int32 tensors of 16-bit patterns (in their low halves) -> one int32 holding both."""
    return (lo & 0xFFFF) | (hi << 16)


@triton.jit
def _halves(bits, FP16: tl.constexpr):
    """Pairs [R, C] int32 -> [R, C, 2]: the two 16-bit floats of each register, fp16 as fp16,
    bf16 as the float32 of its bits (exact; the interpreter's bf16 arithmetic is not)."""
    if FP16:
        return tl.join(bits.to(tl.int16), (bits >> 16).to(tl.int16)).to(tl.float16, bitcast=True)
    return tl.join(bits << 16, bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _gemvp_word_emulated(w, x04, x15, x26, x37, off, off_hi, FP16: tl.constexpr):
    """_GEMVP_ASM_F16 / _BF16 step by step in Triton ops, on the same registers (the
    interpreter's path): the masks, shifts and offsets are the PTX's; bf16 products and sums
    round as float32 here."""
    if FP16:
        t = (w >> 8) & 0x00FFFFFF
        q0 = _halves((w & 0x000F000F) | 0x64006400, True) - _halves(off, True)
        q1 = _halves((w & 0x00F000F0) | 0x64006400, True) * 0.0625 + _halves(off_hi, True)
        q2 = _halves((t & 0x000F000F) | 0x64006400, True) - _halves(off, True)
        q3 = _halves((t & 0x00F000F0) | 0x64006400, True) * 0.0625 + _halves(off_hi, True)
    else:
        q0 = _halves((w & 0x000F000F) | 0x43004300, False) - _halves(off, False)
        q1 = _halves(((w >> 4) & 0x000F000F) | 0x43004300, False) - _halves(off, False)
        q2 = _halves(((w >> 8) & 0x000F000F) | 0x43004300, False) - _halves(off, False)
        q3 = _halves(((w >> 12) & 0x000F000F) | 0x43004300, False) - _halves(off, False)
    a = q0 * _halves(x04, FP16) + q1 * _halves(x15, FP16) + q2 * _halves(x26, FP16) + q3 * _halves(x37, FP16)
    return tl.sum(a.to(tl.float32), axis=2)


@triton.jit
def gemvp_word_sums(w, xa, xb, xc, xd, zero, act: tl.constexpr, ASM: tl.constexpr):
    """Each 4-bit word's eight values minus `zero` times its activations, summed (float32): the
    word's nibble pairs (0, 4), (1, 5), (2, 6), (3, 7) meet the activation pairs xa .. xd (int32
    registers of two 16-bit floats of `act`), in packed 16-bit arithmetic (_GEMVP_ASM_*) or, ASM
    False, its steps in Triton ops. q - zero = (MAGIC + q) - (MAGIC + zero); fp16's high nibbles
    are 1024 + 16 q: x / 16 - (64 + zero)."""
    FP16: tl.constexpr = act == tl.float16
    MAGIC_F: tl.constexpr = 1024.0 if FP16 else 128.0
    off = (MAGIC_F + zero).to(act).to(tl.int16, bitcast=True).to(tl.int32)
    off = _pair_bits(off, off)
    off_hi = (-(MAGIC_F / 16) - zero).to(act).to(tl.int16, bitcast=True).to(tl.int32)
    off_hi = _pair_bits(off_hi, off_hi)
    if ASM:
        wsum = tl.inline_asm_elementwise(
            _GEMVP_ASM_F16 if FP16 else _GEMVP_ASM_BF16, "=f,r,r,r,r,r,r,r", [w, xa, xb, xc, xd, off, off_hi],
            dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    else:
        wsum = _gemvp_word_emulated(w, xa, xb, xc, xd, off, off_hi, FP16)
    return wsum
