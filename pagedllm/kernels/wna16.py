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

Products: few rows run the Triton kernels (the weights read once as integers, dequantized in
registers); from DENSE_MIN_ROWS rows the weight is dequantized into a scratch matrix and cuBLAS
multiplies, which beats the dequantizing Triton GEMM there (it is not yet a good tensor-core
kernel: RESULTS.md).
"""

from __future__ import annotations

import torch

from pagedllm.kernels._triton import use_triton

# From this many rows the CUDA path dequantizes and calls cuBLAS. H200 sweep
# (benchmarks/wna16_bench.py, Llama-3.1-8B's four projections, one layer each): the dequantizing
# GEMM takes 187 us at 16 rows and 363 us at 64, dequantize + cuBLAS about 310 us at 64 rows and
# 383 at 256; the crossover (interpolated) is near 48 rows.
DENSE_MIN_ROWS = 48


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
                           bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The real weight [N, K] in `dtype` (computed in float32)."""
    q = unpack_rows(qweight, bits).float()  # [K, N]
    k = q.shape[0]
    gk = k // scales.shape[0]
    s = scales.float().repeat_interleave(gk, dim=0)
    z = float(1 << (bits - 1)) if zeros is None else zeros.float().repeat_interleave(gk, dim=0)
    return ((q - z) * s).t().to(dtype)


def wna16_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor | None, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x [M, K] @ dequant(qweight).T -> [M, N] in x's dtype (float32 math)."""
    y = x.float() @ dequantize_wna16_torch(qweight, scales, zeros, bits, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) with an integer weight; x [M, K] -> [M, N]. CUDA: the Triton kernels
    below DENSE_MIN_ROWS rows, a dequantized weight and cuBLAS from there. Elsewhere (the CPU)
    the weight is dequantized to x's dtype for its GEMM."""
    if use_triton(x):
        from pagedllm.kernels.wna16_triton import dequantize_wna16_triton, wna16_gemm_triton

        if x.shape[0] >= DENSE_MIN_ROWS:
            y = x @ dequantize_wna16_triton(qweight, scales, zeros, bits, x.dtype)
            return y if bias is None else y + bias
        return wna16_gemm_triton(x, qweight, scales, zeros, bits, bias)
    if x.device.type == "cpu":
        return torch.nn.functional.linear(x, dequantize_wna16_torch(qweight, scales, zeros, bits, x.dtype), bias)
    return wna16_linear_torch(x, qweight, scales, zeros, bits, bias)
