"""Triton FP8 kernels; each must equal its torch reference in fp8.py.

- `fp8_gemm_triton`: W8A16 product x [M, K] @ dequant(weight [N, K] e4m3, weight_scale [N, G]).T.
  The weights are read once, as FP8, and dequantized in registers; activations stay 16-bit.
  Two kernels by row count:
    few rows (M <= GEMV_MAX_ROWS): no tensor cores; one program per (row, BLOCK_N outputs) with
      the row index varying fastest, so the programs of one weight tile run together and the
      tile is read from HBM once (L2 serves the other rows). Each program keeps a
      [BLOCK_N, BLOCK_K] float32 partial and reduces it once at the end.
    more rows: tiles of [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] through `tl.dot`, the weight
      tile converted to the activations' dtype first.
  Scales: G = 1 multiplies the finished row sum once; G > 1 (128-wide K groups of block-wise
  checkpoints) multiplies each K tile's partial by its group's scale (BLOCK_K divides group_k).
- `per_token_quant_triton`: dynamic per-token e4m3 quantization of activations for `_scaled_mm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2
from pagedllm.kernels.fp8 import FP8_MAX, MIN_SCALE

# rows up to which the tensor-core-free kernel runs (H200 sweep: benchmarks/fp8_bench.py)
GEMV_MAX_ROWS = 3


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
):  # fmt: skip
    m = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
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
    """(kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for an [m, k] x [k, n] product;
    from the H200 sweep of benchmarks/fp8_bench.py over Llama-3.1-8B's projections."""
    if m <= GEMV_MAX_ROWS:
        block_k = 512 if group_k == 0 else min(512, group_k)
        return ("gemv", 1, 8, block_k, 8, 3) if m == 1 else ("gemv", 1, 8, min(256, block_k), 4, 2)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = 256 if group_k == 0 else min(256, group_k)
    return ("dot", block_m, 32, block_k, 4, 3)


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
    kind, block_m, block_n, block_k, num_warps, num_stages = config or default_config(m, n, k, group_k)
    assert group_k == 0 or group_k % block_k == 0, "BLOCK_K must divide the scale group"
    b = bias if bias is not None else weight_scale  # unused pointer when HAS_BIAS is False
    even_k = k % block_k == 0
    if kind == "gemv":
        _fp8_gemv_kernel[(m, triton.cdiv(n, block_n))](
            x, weight, weight_scale, b, out, n, k,
            x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
            GROUP_K=group_k, HAS_BIAS=bias is not None, EVEN_K=even_k,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
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
