"""Integer weight-only linears (W4A16, W8A16): the torch references that define each op and the
dispatcher the linear method calls. The Triton kernels live in wna16_triton.py and must equal
these. Every checkpoint format (GPTQ, AWQ, compressed-tensors pack-quantized) is repacked at
load (model/layers/quantization/wna16.py) into this one layout:

    qweight  [K // P, N] int32, P = 32 // bits values per word: the unsigned value of (k, n)
             sits at bits bits * (k % P) of qweight[k // P, n] (K-packed, N contiguous, so a
             row of words is one coalesced read and a word feeds P consecutive inputs)
    scales   [G, N] float16 / bfloat16 / float32; group_k = K // G (G = 1: per output channel)
    zeros    [G, N] in scales' dtype (asymmetric), or None: symmetric, zero = 2 ** (bits - 1)
    real weight  w[n, k] = (q[k, n] - zero[k // group_k, n]) * scales[k // group_k, n]

Act-order checkpoints (GPTQ desc_act) are brought to this layout by a permutation of K applied
to the activations (the linear method's `perm`), never by a second weight layout.

By default (`kperm_enabled`; PAGEDLLM_WNA16_KPERM=0 off) 4-bit layers whose K is whole steps of 128 and whose
groups are whole steps (or per channel) keep their words with K's slots permuted within each step
(`kperm_pack`): slot s = 8j + i + 4h of a step (word j, nibble i + 4h) holds input 32i + 2j + h.
That is the order in which the kpairs GEMM's four dots read a step's nibble pairs, so it reads x
as it is instead of a permuted copy of it (one gather a call otherwise); gemvp's nibble pairs
(i, i + 4) then meet x's consecutive pairs directly, the dot GEMM and the dequantization read each
input from its slot (their outputs bit for bit the plain layout's), the float32 GEMV and dotj
gather x. Groups are unchanged: a slot's input stays in its step.

A second layout, for 4 bits only, feeds the swap-AB tensor-core kernel (wna16_swap_triton.py;
on behind PAGEDLLM_WNA16_SWAP=1, see `swap_enabled`): the weight is N-major, as the MMA's wide
operand wants it, and a word's nibbles are interleaved so that one mask puts two consecutive
inputs into the two halves of a 32-bit register (each then read as fp16 1024 + q):

    qweight  [N, K // 8] int32: inputs 8j .. 8j+7 of output n in word j, input 8j + i at
             nibble NIBBLE_OF[i] = (0, 4, 1, 5, 2, 6, 3, 7)[i] (AWQ's order, inverted):

                 nibble   7    6    5    4    3    2    1    0
                 input   k7   k5   k3   k1   k6   k4   k2   k0
                 (w & 0x000F000F) | 0x64006400 = fp16 pair (1024 + k0, 1024 + k1), and so on

    scales   [N, G] (transposed from the layout above), zeros [N, G] or None

Products: few rows run the Triton kernels (the weights read once as integers, dequantized in
registers); from DENSE_MIN_ROWS (the K-packed layout: `kpairs_min_rows`) to SWAP_GEMM_MAX_ROWS rows
4-bit weights go to a tensor-core GEMM that dequantizes in registers (large_gemm: each layout's
measured best, LAYOUT_DEFAULT), and beyond
(prefill chunks) or with PAGEDLLM_WNA16_GEMM=dense, or for 8-bit weights, the weight is dequantized
into a scratch matrix and cuBLAS multiplies.
"""

from __future__ import annotations

import functools
import os

import torch

from pagedllm.kernels._triton import capability_major, env_flag, use_triton

# The CUDA path's GEMVs (wna16_gemv_triton.py) take at most this many rows.
GEMV_MAX_ROWS = 4
# From this many rows the CUDA path dequantizes and calls cuBLAS. H200 sweep
# (benchmarks/wna16_bench.py, Llama-3.1-8B's four projections, one layer each): the dequantizing
# GEMM takes 187 us at 16 rows and 363 us at 64, dequantize + cuBLAS about 310 us at 64 rows and
# 383 at 256; the crossover (interpolated) is near 48 rows.
DENSE_MIN_ROWS = 48
# With PAGEDLLM_WNA16_GEMM=swap, the swap-AB GEMM takes DENSE_MIN_ROWS to SWAP_GEMM_MAX_ROWS rows,
# and dequantize + cuBLAS more. H100 (benchmarks/wna16_bench.py --swap, Llama-3.1-8B's four
# projections x 32 layers, ms a step): at 256 rows bf16 6.84, the swap GEMM 11.05, dequantize +
# cuBLAS 13.90. The dequantization costs a fixed ~7.1 ms a step, the swap GEMM ~4.2 ms more than
# bf16 per 256 rows (compute-bound at ~0.62x cuBLAS): they cross near 430 rows. But the same sweep
# found the swap GEMM wrong on gate_up (28,672 x 4,096) at 512 rows, bf16, where the interpreter
# (fp16) is right; until that is understood it takes no more rows than the sweep checked right on
# every projection: 256. W1's prefill chunks (thousands of rows) go to cuBLAS either way. The pairs
# kernels (PAGEDLLM_WNA16_GEMM=pairs) take the same bound until they are timed.
SWAP_GEMM_MAX_ROWS = 256


def group_width(k: int, groups: int, multiple: int = 1) -> int:
    """The inputs one scale group of a k-input integer weight spans, 0 for a single group (per
    channel); the groups must tile k in whole multiples of `multiple` (a packed word's inputs)."""
    width = 0 if groups == 1 else k // groups
    assert width % multiple == 0 and width * groups in (0, k), f"{groups} groups over {k} inputs"
    return width


def pack_factor(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return 32 // bits


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [R, C] (0 .. 2**bits - 1) -> [R // P, C] int32, value r at bits
    bits * (r % P) of word r // P."""
    p = pack_factor(bits)
    r, c = q.shape
    if r % p:
        raise ValueError(f"{r} rows do not pack into {bits}-bit words of {p}")
    q = q.to(torch.int64).view(r // p, p, c)
    shifts = (torch.arange(p, device=q.device, dtype=torch.int64) * bits).view(1, p, 1)
    word = (q << shifts).sum(dim=1)  # disjoint bit ranges: the sum is the bitwise or
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R // P, C] int32 -> [R, C] int32 unsigned values (inverse of `pack_rows`)."""
    p = pack_factor(bits)
    rp, c = packed.shape
    shifts = (torch.arange(p, device=packed.device, dtype=torch.int32) * bits).view(1, p, 1)
    return ((packed.reshape(rp, 1, c) >> shifts) & ((1 << bits) - 1)).reshape(rp * p, c)


def quantize_wna16_torch(w: torch.Tensor, bits: int, group_k: int | None, symmetric: bool = True,
                         scale_dtype: torch.dtype | None = None):
    """Round-to-nearest integer quantization of an [N, K] weight in groups of group_k inputs
    (None: per output channel). Returns (qweight [K // P, N], scales [G, N], zeros [G, N] or
    None) in this module's layout."""
    n, k = w.shape
    gk = k if group_k is None else group_k
    if k % gk:
        raise ValueError(f"group size {gk} does not divide {k} inputs")
    qmax = (1 << bits) - 1
    wg = w.float().t().reshape(k // gk, gk, n)  # [G, group, N]
    if symmetric:
        zero = 1 << (bits - 1)
        scale = (wg.abs().amax(dim=1) / (zero - 0.5)).clamp(min=1e-8)  # |w| <= (zero - 0.5) * s
        q = torch.round(wg / scale[:, None]) + zero
        zeros = None
    else:
        lo, hi = wg.amin(dim=1), wg.amax(dim=1)
        scale = ((hi - lo) / qmax).clamp(min=1e-8)
        zf = torch.round(-lo / scale).clamp(0, qmax)
        q = torch.round(wg / scale[:, None]) + zf[:, None]
        zeros = zf
    q = q.clamp(0, qmax).to(torch.int32).reshape(k, n)
    sd = scale_dtype or w.dtype
    return pack_rows(q, bits), scale.to(sd), None if zeros is None else zeros.to(sd)


def dequantize_wna16_torch(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                           bits: int, dtype: torch.dtype, kperm: bool = False) -> torch.Tensor:
    """The real weight [N, K] in `dtype` (computed in float32); kperm: qweight's slots permuted
    within their steps (`kperm_pack`)."""
    q = unpack_rows(qweight, bits).float()  # [K, N]
    k = q.shape[0]
    gk = k // scales.shape[0]
    s = scales.float().repeat_interleave(gk, dim=0)
    z = float(1 << (bits - 1)) if zeros is None else zeros.float().repeat_interleave(gk, dim=0)
    w = (q - z) * s  # [K slots, N]
    if kperm:  # input c sits in slot p[c]
        w = w.index_select(0, kpairs_permutation(k, KPERM_STEP, w.device))
    return w.t().to(dtype)


def wna16_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       bits: int, bias: torch.Tensor | None = None, kperm: bool = False) -> torch.Tensor:
    """Reference: x [M, K] @ dequant(qweight).T -> [M, N] in x's dtype (float32 math)."""
    y = x.float() @ dequantize_wna16_torch(qweight, scales, zeros, bits, torch.float32, kperm).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, bias: torch.Tensor | None = None, kperm: bool = False) -> torch.Tensor:
    """y = x @ w.T (+ bias) with an integer weight; x [M, K] -> [M, N]. CUDA: the Triton kernels
    below DENSE_MIN_ROWS rows; 4-bit weights from kpairs_min_rows (GEMV_MAX_ROWS + 1 unless set) up to
    SWAP_GEMM_MAX_ROWS rows the kpairs tensor-core GEMM on sm_90+ (large_gemm: the default, or
    PAGEDLLM_WNA16_GEMM=pairs; PAGEDLLM_WNA16_DENSE_FROM takes small weights from a row count on to the
    dequantized weight instead, `dense_from`), else from DENSE_MIN_ROWS a dequantized weight and cuBLAS. kpairs is
    Hopper's: its tiles are sized to sm_90's 227 KB of shared memory (its 256-row tiles compiled for
    sm_80 take 172 KB, more than an A100's 163, and its 128-row ones 107 KB, more than an L4's 99), so
    sm_80-89 take the few-row kernels and the dequantized weight there (the interpreter's tests, CPU
    tensors under a patched use_triton, keep kpairs). Elsewhere (the CPU) the weight
    is dequantized to x's dtype for its GEMM. kperm: qweight's slots permuted within their steps
    (`kperm_pack`)."""
    if use_triton(x):
        from pagedllm.kernels.wna16_triton import dequantize_wna16_triton, wna16_gemm_triton

        m = x.shape[0]
        dense = dense_from()
        if (bits == 4 and (large_gemm() or LAYOUT_DEFAULT["k_packed"]) == "pairs"
                and kpairs_min_rows() <= m <= SWAP_GEMM_MAX_ROWS
                and not (dense and m >= dense[0] and qweight.numel() * 8 <= dense[1])
                and (not x.is_cuda or capability_major(x.device.index or 0) >= 9)):  # fmt: skip
            from pagedllm.kernels.wna16_kpairs_triton import wna16_kpairs_gemm

            return wna16_kpairs_gemm(x, qweight, scales, zeros, bias, kperm=kperm)
        if m >= DENSE_MIN_ROWS:
            y = x @ dequantize_wna16_triton(qweight, scales, zeros, bits, x.dtype, kperm)
            return y if bias is None else y + bias
        return wna16_gemm_triton(x, qweight, scales, zeros, bits, bias, kperm=kperm)
    if x.device.type == "cpu":
        w = dequantize_wna16_torch(qweight, scales, zeros, bits, x.dtype, kperm)
        return torch.nn.functional.linear(x, w, bias)
    return wna16_linear_torch(x, qweight, scales, zeros, bits, bias, kperm)


# ---- the steps-permuted K-packed layout (module docstring) -----------------------------------
KPERM_STEP = 128


@functools.cache
def kpairs_permutation(k_padded: int, block_k: int, device: torch.device) -> torch.Tensor:
    """Indices p [k_padded] with x' = x[:, p], the order in which the kpairs GEMM's dots read x
    (wna16_kpairs_triton.py): within each K step of block_k inputs, position i * block_k / 4 + 2j + h
    takes input 8j + i + 4h (i < 4, j < block_k / 8, h < 2). At KPERM_STEP it also defines the
    steps-permuted layout, which stores input c in slot p[c]."""
    # made on the device (no host copy: a first call may come inside a CUDA graph's capture)
    i, j, h = torch.meshgrid(torch.arange(4, device=device), torch.arange(block_k // 8, device=device),
                             torch.arange(2, device=device), indexing="ij")  # fmt: skip
    step = (8 * j + i + 4 * h).reshape(-1)  # position i * block_k / 4 + 2j + h, in that order
    return (torch.arange(0, k_padded, block_k, device=device)[:, None] + step[None, :]).reshape(-1)


def kperm_applies(k: int, group_k: int) -> bool:
    """Whether a K-packed 4-bit weight of k inputs in groups of group_k (0: per channel) can take
    the steps-permuted layout: whole steps, each within one group."""
    return k > 0 and k % KPERM_STEP == 0 and group_k % KPERM_STEP == 0


def kperm_pack(qweight: torch.Tensor) -> torch.Tensor:
    """A K-packed 4-bit qweight [K / 8, N] -> the same weight in the steps-permuted layout: input c
    in slot p[c], p the kpairs permutation at KPERM_STEP (the slot of x' column c's input)."""
    q = unpack_rows(qweight, 4)
    return pack_rows(torch.empty_like(q).index_copy_(0, kpairs_permutation(q.shape[0], KPERM_STEP, q.device), q), 4)


@functools.cache
def kperm_enabled() -> bool:
    """Whether 4-bit K-packed layers that `kperm_applies` to store the steps-permuted layout, so that
    the kpairs GEMM gathers no permuted copy of x (read once, when layers' weights are processed): on
    unless PAGEDLLM_WNA16_KPERM=0. With kpairs from 5 rows, W1 Llama-3.1-8B gptq 7,869 -> 8,574
    tok/s on the H100 (0.957x bf16; RESULTS.md twenty-second session)."""
    return env_flag("PAGEDLLM_WNA16_KPERM", default=True)


@functools.cache
def kpairs_min_rows() -> int:
    """The fewest rows the K-packed layout's 4-bit linears give the kpairs GEMM (to
    SWAP_GEMM_MAX_ROWS), from PAGEDLLM_WNA16_KPAIRS_FROM (read once; unset: the row after gemvp's
    last, GEMV_MAX_ROWS + 1). Below it the few-row Triton kernels run: gemvp to GEMV_MAX_ROWS rows, then
    the "dot" GEMM, which dequantizes in float32 (sm_90: about 13 instructions a weight at its
    16-row tiles against kpairs' 4 at 16-row tiles, RESULTS.md twenty-first session); from 48 rows
    before the twenty-second session, when W1 gptq on the H100 took 7,869 -> 8,574 tok/s from it
    and the steps-permuted layout together."""
    value = os.environ.get("PAGEDLLM_WNA16_KPAIRS_FROM", "").strip()
    if not value:
        return GEMV_MAX_ROWS + 1
    if not value.isdigit() or not 2 <= int(value) <= SWAP_GEMM_MAX_ROWS + 1:
        raise ValueError(f"PAGEDLLM_WNA16_KPAIRS_FROM={value!r}: expected a row count from 2 to "
                         f"{SWAP_GEMM_MAX_ROWS + 1}")
    return int(value)


# PAGEDLLM_WNA16_DENSE_FROM's default bound on the weight: Llama-3.1-8B's q/k/v (25.2M) and o (16.8M)
DENSE_FROM_MAX_WEIGHT = 1 << 25


@functools.cache
def dense_from() -> tuple[int, int] | None:
    """PAGEDLLM_WNA16_DENSE_FROM=ROWS[:WEIGHTS] (read once; unset or empty: off): 4-bit linears of at
    least ROWS rows (DENSE_MIN_ROWS to SWAP_GEMM_MAX_ROWS) whose weight has at most WEIGHTS values (N x K;
    default DENSE_FROM_MAX_WEIGHT) take the dequantized weight and cuBLAS instead of kpairs. At 160-256
    rows kpairs' q/k/v and o take about twice cuBLAS's bf16 time (RESULTS.md twentieth session), while
    dequantizing their weights is a bandwidth-bound write of 2 bytes a value, which the H200's faster
    memory shortens: an opt-in for issue 19's W1, not yet timed. Returns (ROWS, WEIGHTS) or None."""
    value = os.environ.get("PAGEDLLM_WNA16_DENSE_FROM", "").strip()
    if not value:
        return None
    rows, sep, weights = value.partition(":")
    if (not rows.isdigit() or not DENSE_MIN_ROWS <= int(rows) <= SWAP_GEMM_MAX_ROWS
            or (sep and not weights.isdigit())):  # fmt: skip
        raise ValueError(f"PAGEDLLM_WNA16_DENSE_FROM={value!r}: expected ROWS[:WEIGHTS], ROWS from "
                         f"{DENSE_MIN_ROWS} to {SWAP_GEMM_MAX_ROWS}, WEIGHTS a count of weight values")
    return int(rows), int(weights) if sep else DENSE_FROM_MAX_WEIGHT


# ---- the N-major interleaved int4 layout of the swap-AB kernel --------------------------------
NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)  # input i of a word's eight sits at nibble NIBBLE_OF[i]


def swap_enabled() -> bool:
    """PAGEDLLM_WNA16_SWAP=1 sends 4-bit linears of 1-47 rows to the swap-AB tensor-core kernel
    (and stores their weights in the N-major layout). Off by default: on the H200 it beat the
    K-packed kernels at 4-16 rows (Llama-3.1-8B's projections 3.18 vs 6.76 ms a step at 4) but
    lost at one row (3.64 vs 2.36; W2 5.22 vs 3.84 ms/token), and a layer has one layout.
    Read when a layer's weights are processed."""
    value = os.environ.get("PAGEDLLM_WNA16_SWAP", "0").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"PAGEDLLM_WNA16_SWAP={value!r}: expected 0 or 1")


def pack_int4_nk(q: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values [K, N] -> [N, K // 8] int32 in the interleaved order above."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"{k} inputs do not pack into words of 8")
    q = q.t().to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.tensor([4 * s for s in NIBBLE_OF], device=q.device, dtype=torch.int64)
    word = (q << shifts).sum(dim=2)  # disjoint nibbles: the sum is the bitwise or
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_int4_nk(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 8] int32 -> [K, N] int32 values (inverse of `pack_int4_nk`)."""
    n, kw = packed.shape
    shifts = torch.tensor([4 * s for s in NIBBLE_OF], device=packed.device, dtype=torch.int32)
    return ((packed.reshape(n, kw, 1) >> shifts) & 0xF).reshape(n, kw * 8).t()


def to_int4_nk(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None):
    """The K-packed layout (qweight [K // 8, N], scales / zeros [G, N]) -> the N-major one
    (qweight [N, K // 8], scales / zeros [N, G]), contiguous."""
    q = pack_int4_nk(unpack_rows(qweight, 4))
    return q, _transposed(scales), None if zeros is None else _transposed(zeros)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    # a fresh [C, R] tensor with unit stride along R, even where R is 1
    return t.t().contiguous().reshape(-1).view(t.shape[1], t.shape[0])


def dequantize_int4_nk_torch(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                             dtype: torch.dtype) -> torch.Tensor:
    """The real weight [N, K] in `dtype` (float32 math) from the N-major layout."""
    q = unpack_int4_nk(qweight).float()  # [K, N]
    k = q.shape[0]
    gk = k // scales.shape[1]
    s = scales.float().t().repeat_interleave(gk, dim=0)
    z = 8.0 if zeros is None else zeros.float().t().repeat_interleave(gk, dim=0)
    return ((q - z) * s).t().to(dtype)


def wna16_int4_nk_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                               zeros: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x [M, K] @ dequant(N-major qweight).T (+ bias) -> [M, N] in x's dtype (float32 math)."""
    y = x.float() @ dequantize_int4_nk_torch(qweight, scales, zeros, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# Each 4-bit layout's large-row GEMM when PAGEDLLM_WNA16_GEMM is unset: its best on W1 (Llama-3.1-8B,
# 256 requests; RESULTS.md, H100): the K-packed layout's kpairs GEMM 0.834x / 0.839x bf16 against
# 0.704x dequantize + cuBLAS; the N-major layout's bounded swap-AB GEMM 0.863x (0.791x unbounded).
LAYOUT_DEFAULT = {"k_packed": "pairs", "n_major": "swap"}


@functools.cache
def large_gemm() -> str | None:
    """How 4-bit linears multiply DENSE_MIN_ROWS rows or more, from PAGEDLLM_WNA16_GEMM: "dense" (the
    weight dequantized to x's dtype, then cuBLAS), or up to SWAP_GEMM_MAX_ROWS rows a tensor-core
    W4A16 GEMM that dequantizes in registers: "swap" the N-major layout's swap-AB kernel (64- /
    128-row activation tiles), "pairs" the same layout's pairs kernel (SwapConfig.pairs) and the
    K-packed layout's kpairs kernel (wna16_kpairs_triton.py). None when unset: each layout's
    LAYOUT_DEFAULT. Read once per process."""
    value = os.environ.get("PAGEDLLM_WNA16_GEMM", "").strip().lower()
    if not value:
        return None
    if value not in ("dense", "swap", "pairs"):
        raise ValueError(f"PAGEDLLM_WNA16_GEMM={value!r}: expected dense, swap or pairs")
    return value


def wna16_int4_nk_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         zeros: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) with a 4-bit weight in the N-major layout; x [M, K] -> [M, N]. CUDA:
    one 16-bit row the N-major GEMV (wna16_gemvn_triton.py), then the swap-AB kernel up to
    DENSE_MIN_ROWS rows (16 rows a program), from there up to SWAP_GEMM_MAX_ROWS rows the swap-AB
    GEMM (large_gemm: the default "swap", or its pairs variant), else the weight dequantized to x's
    dtype and cuBLAS. Elsewhere: the dequantized weight and x's GEMM."""
    if use_triton(x):
        from pagedllm.kernels.wna16_gemvn_triton import GEMVN_MAX_ROWS, wna16_gemvn
        from pagedllm.kernels.wna16_swap_triton import dequantize_int4_nk_triton, wna16_swap_gemm

        m = x.shape[0]
        if m <= GEMVN_MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16):
            return wna16_gemvn(x, qweight, scales, zeros, bias)
        mode = large_gemm() or LAYOUT_DEFAULT["n_major"]
        if m >= DENSE_MIN_ROWS and (mode == "dense" or m > SWAP_GEMM_MAX_ROWS):
            return torch.nn.functional.linear(x, dequantize_int4_nk_triton(qweight, scales, zeros, x.dtype), bias)
        return wna16_swap_gemm(x, qweight, scales, zeros, bias, pairs=m >= DENSE_MIN_ROWS and mode == "pairs")
    if x.device.type == "cpu":
        return torch.nn.functional.linear(x, dequantize_int4_nk_torch(qweight, scales, zeros, x.dtype), bias)
    return wna16_int4_nk_linear_torch(x, qweight, scales, zeros, bias)
