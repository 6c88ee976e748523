"""The few-rows linear kernel (see few_rows.py, whose torch reference it must equal)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.attention import _dot_precision

BLOCK_M = 16  # the narrow MMA operand: rows padded to 16


@triton.jit
def _few_rows_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (read if HAS_BIAS)
    out_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]: x.T's columns
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K  # constant over 16-aligned runs when K % 16 == 0: the loads stay vectorized
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(w, xt.to(w.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rm[None, :] * stride_om + rn[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def default_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): about one program per SM or more (132 on the
    H200) with 8 KB weight tiles, 4 in flight. Not swept on the device yet."""
    block_n = 16 if n <= 4096 else 32
    block_k = 256 if block_n == 16 else 128
    return block_n, min(block_k, max(16, triton.next_power_of_2(k))), 4, 4


def few_rows_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out_dtype: torch.dtype | None = None, config: tuple | None = None) -> torch.Tensor:
    # x: [M <= 16, K]; weight: [N, K] -> [M, N] in out_dtype (x's by default)
    m, k = x.shape
    n = weight.shape[0]
    assert m <= BLOCK_M and weight.shape[1] == k and weight.stride(1) == 1
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_n, block_k, num_warps, num_stages = config or default_config(n, k)
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, DOT_PRECISION=_dot_precision(weight.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
