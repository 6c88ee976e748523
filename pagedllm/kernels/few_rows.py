"""Unquantized linear products of a few rows (batch-1/-few decode) as one Triton kernel, beside
the torch product it must equal. Switchable, off by default until measured on the H200:
PAGEDLLM_FEW_ROWS_GEMV=N sends products of at most N (<= 16) rows on CUDA to the kernel
(`few_rows_max_rows`, read once when a layer is built).

Why: at one row cuBLAS reads the dense projections of Qwen3-30B-A3B (q/k/v 21 MB, o 17 MB a layer)
at ~2.3 TB/s on the H200 and the router's [128, 2048] at 0.1 TB/s (5 us for 0.5 MB).

    out.T [BLOCK_N, 16] += W tile [BLOCK_N, BLOCK_K] @ x.T tile [BLOCK_K, 16]

the weight tile is the wide MMA operand, the rows the narrow one padded to 16 (the layout of
fp8_triton.py's swap-AB kernel, here for bf16/fp16/float32 weights): one program per BLOCK_N
outputs, narrow tiles so that even a 2048-wide output has one program per SM.
"""

from __future__ import annotations

import os

import torch

from pagedllm.kernels._triton import use_triton

FEW_ROWS_ENV = "PAGEDLLM_FEW_ROWS_GEMV"
MAX_ROWS = 16


def few_rows_max_rows(environ=os.environ) -> int:
    """Most rows served by the few-rows kernel (0: off), from PAGEDLLM_FEW_ROWS_GEMV."""
    raw = environ.get(FEW_ROWS_ENV, "0").strip()
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{FEW_ROWS_ENV}={raw!r}: expected a number of rows in [0, {MAX_ROWS}]") from None
    if not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"{FEW_ROWS_ENV}={rows}: must be in [0, {MAX_ROWS}] (0 turns the kernel off)")
    return rows


def few_rows_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reference: x [M, K] @ weight [N, K].T (+ bias) accumulated in float32 -> [M, N] in
    out_dtype (x's dtype by default)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if use_triton(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
        from pagedllm.kernels.few_rows_triton import few_rows_linear_triton

        return few_rows_linear_triton(x, weight, bias, out_dtype)
    return few_rows_linear_torch(x, weight, bias, out_dtype)
