"""Triton FP8 kernels; each must equal its torch reference in fp8.py.

- `fp8_gemm_triton`: W8A16 product x [M, K] @ dequant(weight [N, K] e4m3, weight_scale [N, G]).T.
  The weights are read once, as FP8, and dequantized in registers; activations stay 16-bit.
  Four kernels by row count and shape (`default_config`, from the H200 sweeps of benchmarks/fp8_bench.py):
    "gemv": no tensor cores; one program per (row, BLOCK_N outputs) with the row index varying
      fastest, so the programs of one weight tile run together and the tile is read from HBM
      once (L2 serves the other rows). Each program keeps a [BLOCK_N, BLOCK_K] float32 partial
      and reduces it once at the end. Every weight goes e4m3 -> f16 -> f32 on CUDA cores.
    "gemv_unrolled" (one row, wide N): the GEMV loading UNROLL tiles before using any and
      folding each into a [BLOCK_N] accumulator at once, so more weight bytes are in flight
      per thread without a larger accumulator (Triton does not pipeline a loop without a dot).
    "swap" (1-16 rows): the swap-AB tensor-core kernel of swap_gemm_triton.py (shared with the
      16-bit dense path), acc [BLOCK_N, 16] += W tile (e4m3 -> fp16) @ x.T tile: the weight
      is the wide MMA operand, e4m3 -> fp16 one paired conversion, bf16 activations as fp16
      operands (saturated at +-65504); optional split-K through a float32 workspace.
    "dot" (more rows): tiles of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] through `tl.dot`, the
      weight tile converted to the activations' dtype first.
  Scales: G = 1 multiplies the finished row sum once (the epilogue); G > 1 (128-wide K groups of
  block-wise checkpoints) multiplies each K tile's partial by its group's scale (BLOCK_K divides
  group_k).
- `per_token_quant_triton`: dynamic per-token e4m3 quantization of activations for `_scaled_mm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl_weights
from pagedllm.kernels.fp8 import FP8_MAX, MIN_SCALE
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait, prefetch_rows_l2
from pagedllm.kernels.swap_gemm_triton import SWAP_BLOCK_M, SwapConfig, swap_gemm


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] activations (16- or 32-bit)
    w_ptr,  # [N, K] float8 e4m3
    s_ptr,  # [N, G] float32
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N]
    N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr,  # 0: one scale per row (G = 1); else the K width of a scale group
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0,  # kernels/pdl_triton.py
):  # fmt: skip
    pdl_release(PDL)
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    if PREFETCH_K > 0:
        prefetch_rows_l2(w_ptr + rn64 * stride_wn, n_mask, 0, K, PREFETCH_K)
    pdl_wait(PDL)
    w_rows = w_ptr + rn64[:, None] * stride_wn
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            x = tl.load(x_row + kk)
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = kk < K
            x = tl.load(x_row + kk, mask=k_mask, other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
        if GROUP_K > 0:
            s = tl.load(s_ptr + rn64 * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            prod = prod * s[:, None]
        acc += prod
    y = tl.sum(acc, axis=1)
    if GROUP_K == 0:
        y = y * tl.load(s_ptr + rn64 * stride_sn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _fp8_gemv_unrolled_kernel(
    x_ptr,  # [M, K] activations (16- or 32-bit)
    w_ptr,  # [N, K] float8 e4m3
    s_ptr,  # [N, G] float32
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N]
    N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH_K: tl.constexpr = 0,  # kernels/pdl_triton.py
):  # fmt: skip
    # The GEMV with more weight bytes in flight per thread: each iteration loads UNROLL tiles
    # [BLOCK_N, BLOCK_K] before using any, and folds each tile's products into a [BLOCK_N]
    # accumulator at once (so the registers a tile needs do not grow the accumulator).
    # K must be a multiple of BLOCK_K * UNROLL (the dispatcher checks).
    pdl_release(PDL)
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    if PREFETCH_K > 0:
        prefetch_rows_l2(w_ptr + rn64 * stride_wn, n_mask, 0, K, PREFETCH_K)
    pdl_wait(PDL)
    w_rows = w_ptr + rn64[:, None] * stride_wn
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K * UNROLL):
        for u in tl.static_range(UNROLL):
            kk = k0 + u * BLOCK_K + rk
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_row + kk)
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            if GROUP_K > 0:
                part = part * tl.load(s_ptr + rn64 * stride_sn + (k0 + u * BLOCK_K) // GROUP_K, mask=n_mask, other=0.0)
            acc += part
    if GROUP_K == 0:
        acc = acc * tl.load(s_ptr + rn64 * stride_sn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] float8 e4m3
    s_ptr,  # [N, G] float32
    b_ptr,  # [N]
    out_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    rn64 = rn.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn64[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        else:
            k_mask = kk < K
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        w = w.to(x.dtype)
        if GROUP_K > 0:
            s = tl.load(s_ptr + rn64 * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if GROUP_K == 0:
        acc = acc * tl.load(s_ptr + rn64 * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_config(m: int, n: int, k: int, group_k: int) -> tuple:
    """(kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]) for an [m, k] x [k, n]
    product; from the H200 sweeps of benchmarks/fp8_bench.py over Llama-3.1-8B's projections
    (us per layer in CUDA graphs, recorded in benchmarks/RESULTS.md):

    - 1 row: the CUDA-core GEMV, 32 weights per thread and tile. A 4 x 1024 tile for N <= 4096
      (o 7.8 -> 6.9 us, down 21.1 -> 17.1 against the earlier 8 x 512), 16 x 512 with 8 warps for
      mid-size N (qkv 9.1). Wide N (gate_up, an LM head): the unrolled GEMV, two 32 x 256 tiles
      in flight with 4 warps (gate_up 32.4 -> 29.9 us; it loses on the other shapes: o 7.4,
      down 19.0). The swap-AB kernel is slower at one row (qkv 11.7, gate_up 34.7, down 22.9).
    - 2-16 rows: the swap-AB kernel (qkv ~11.8 us against 14.2-15.7 before, down 23.5 against
      34-37, gate_up 36.3 against 42-55), 128-wide weight tiles for wide N, else 64-wide with
      split-K 4; except 2 rows of a small square product, where the GEMV's 16 x 512 tile won
      (o: 8.9 us).
    - more rows: the tl.dot kernel (from SCALED_MM_MIN_ROWS rows fp8.py calls `_scaled_mm`).
    """
    gk = group_k or 1 << 30  # BLOCK_K must divide the scale group

    def bk(want: int) -> int:
        return min(want, gk)

    if m == 1:
        if n <= 4096:
            return ("gemv", 1, 4, bk(1024), 4, 2)
        if n >= 16384:
            if k % (2 * bk(256)) == 0:
                return ("gemv_unrolled", 1, 32, bk(256), 4, 1, 2)
            return ("gemv", 1, 16, bk(256), 4, 2)
        return ("gemv", 1, 16, bk(512), 8, 2)
    if m == 2 and n <= 4096 and k <= 4096:
        return ("gemv", 1, 16, bk(512), 8, 2)
    if m <= SWAP_BLOCK_M:
        wide = n >= 16384
        return ("swap", SWAP_BLOCK_M, 128 if wide else 64, bk(128), 4, 3, 1 if wide else 4)
    block_m = 32 if m <= 32 else 64
    return ("dot", block_m, 32, bk(256), 4, 3)


def fp8_gemm_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous rows
    weight_scale: torch.Tensor,  # [N, G] float32
    bias: torch.Tensor | None = None,  # [N]
    config: tuple | None = None,  # see default_config
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = weight.shape[0]
    g = weight_scale.shape[1]
    assert weight.shape[1] == k and weight.stride(1) == 1 and weight_scale.shape[0] == n
    if x.stride(-1) != 1:
        x = x.contiguous()
    group_k = 0 if g == 1 else -(-k // g)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    kind, block_m, block_n, block_k, num_warps, num_stages, *rest = config or default_config(m, n, k, group_k)
    split_k = rest[0] if rest else 1
    assert group_k == 0 or group_k % block_k == 0, "BLOCK_K must divide the scale group"
    b = bias if bias is not None else weight_scale  # unused pointer when HAS_BIAS is False
    even_k = k % block_k == 0
    if kind == "gemv":
        _fp8_gemv_kernel[(m, triton.cdiv(n, block_n))](
            x, weight, weight_scale, b, out, n, k,
            x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
            GROUP_K=group_k, HAS_BIAS=bias is not None, EVEN_K=even_k,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
            **pdl_weights(x, weight, block_k),
        )  # fmt: skip
    elif kind == "gemv_unrolled":
        unroll = split_k  # the config's last field
        assert k % (block_k * unroll) == 0, "the unrolled GEMV wants K a multiple of BLOCK_K * UNROLL"
        _fp8_gemv_unrolled_kernel[(m, triton.cdiv(n, block_n))](
            x, weight, weight_scale, b, out, n, k,
            x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
            GROUP_K=group_k, HAS_BIAS=bias is not None,
            BLOCK_N=block_n, BLOCK_K=block_k, UNROLL=unroll, num_warps=num_warps, num_stages=num_stages,
            **pdl_weights(x, weight, block_k, tiles=unroll),
        )  # fmt: skip
    elif kind == "swap":
        swap_gemm(x, weight, bias, out, SwapConfig(block_n, block_k, split_k, num_warps, num_stages),
                  weight_scale, group_k)
    else:
        _fp8_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
            x, weight, weight_scale, b, out, m, n, k,
            x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
            GROUP_K=group_k, HAS_BIAS=bias is not None, EVEN_K=even_k,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return out


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                            FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_, MIN_SCALE_)
    q = tl.clamp(x / scale, -FP8_MAX_, FP8_MAX_)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scale [M, 1] float32); equals `per_token_quant_torch`."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = next_power_of_2(k)
        _per_token_quant_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX_=FP8_MAX,
                                      MIN_SCALE_=MIN_SCALE, BLOCK=block,
                                      num_warps=4 if block <= 4096 else 8)  # fmt: skip
    return q, s
