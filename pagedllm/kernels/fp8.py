"""FP8 (e4m3) linear algebra: the torch references that define each op, and the dispatcher the
FP8 linear method calls. The Triton kernels live in fp8_triton.py and must equal these.

Weight layout (one format for every FP8 source: online, per-tensor, per-channel, 128x128 block):

    weight        [N, K] float8_e4m3fn, row-major like nn.Linear
    weight_scale  [N, G] float32, G = number of K groups; group_k = K // G
                  (G = 1: one scale per output channel; block-wise checkpoints keep their
                  128-wide K groups, each row carrying its block's scale)
    real weight   w[n, k] = weight[n, k] * weight_scale[n, k // group_k]

Two products:
- W8A16 (`fp8_linear_torch`, Triton `fp8_gemm_triton`): activations stay in the model's dtype,
  weights are dequantized in registers. A batch-1 decode step is bound by reading the weights,
  so halving their bytes is the whole win; no activation rounding.
- W8A8 (`fp8_scaled_mm_torch`, cuBLAS `torch._scaled_mm`): activations quantized per token
  (dynamic scales), FP8 tensor cores. Wins once the product is compute-bound (many rows);
  only for per-channel scales (G = 1).
`fp8_linear` picks by row count (SCALED_MM_MIN_ROWS, from the measured crossover).

`Fp8Rows`: activations already quantized per token by the kernel that made them (the gated
activation's, activation_triton.py), which `fp8_rows_linear` multiplies without a quantization
kernel of its own; `takes_fp8_rows` says where the W8A8 product would run, so where such rows help.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.kernels._triton import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Per-row scales never below this (an all-zero row would give scale 0 and 0/0 on dequantize).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# From this many rows `torch._scaled_mm` (W8A8 on FP8 tensor cores) beats the Triton W8A16
# kernel on the H200 (benchmarks/fp8_bench.py, recorded in benchmarks/RESULTS.md).
SCALED_MM_MIN_ROWS = 64


def quantize_fp8_torch(w: torch.Tensor, group_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric FP8 quantization of an [N, K] weight: one scale per row (group_k None) or per
    (row, K group of group_k). Returns (weight [N, K] e4m3, weight_scale [N, G] float32)."""
    n, k = w.shape
    g = 1 if group_k is None else -(-k // group_k)
    gk = k if group_k is None else group_k
    wf = w.float()
    pad = g * gk - k
    if pad:
        wf = torch.nn.functional.pad(wf, (0, pad))
    wg = wf.view(n, g, gk)
    scale = (wg.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [N, G]
    q = (wg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(n, g * gk)[:, :k]
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_torch(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] e4m3 and [N, G] scales -> the real weight [N, K] in `dtype` (computed in float32)."""
    n, k = weight.shape
    g = weight_scale.shape[1]
    gk = -(-k // g)
    scale = weight_scale.repeat_interleave(gk, dim=1)[:, :k] if g > 1 else weight_scale
    return (weight.float() * scale).to(dtype)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A16 reference: x [M, K] @ dequant(weight).T -> [M, N] in x's dtype (float32 math)."""
    y = x.float() @ dequantize_fp8_torch(weight, weight_scale, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def per_token_quant_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 quantization: x [M, K] -> (e4m3 [M, K], scale [M, 1] float32)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_scaled_mm_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 reference (what `_scaled_mm` computes): x quantized per token, weight per channel."""
    xq, xs = per_token_quant_torch(x)
    y = (xq.float() @ weight.float().t()) * xs * weight_scale.view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class Fp8Rows(NamedTuple):
    """Activations [T, K] quantized per token (`per_token_quant_torch`'s values) by the kernel that
    computed them, for a W8A8 product whose result is in `dtype` (the activations' own)."""

    data: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype


def takes_fp8_rows(x: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether `fp8_linear(x, ...)` multiplies per-token FP8 rows (W8A8, `_scaled_mm`): CUDA, at
    least SCALED_MM_MIN_ROWS rows of 16-bit activations, per-channel weight scales. `x` may be any
    tensor with the activations' rows, dtype and device (e.g. the input of the kernel making them)."""
    return (use_triton(x) and x.shape[0] >= SCALED_MM_MIN_ROWS and weight_scale.shape[1] == 1
            and x.dtype in (torch.bfloat16, torch.float16))


def fp8_rows_linear(rows: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_scaled_mm_torch` of the activations `rows` holds, from their FP8 values and scales
    (cuBLAS `_scaled_mm`): [T, N] in rows.dtype."""
    y = torch._scaled_mm(rows.data, weight.t(), scale_a=rows.scale, scale_b=weight_scale.view(1, -1),
                         out_dtype=rows.dtype)
    return y if bias is None else y + bias


def fp8_rows(x: torch.Tensor) -> Fp8Rows:
    """x [..., K] quantized per token as Fp8Rows [T, K]: the Triton kernel on CUDA
    (`per_token_quant_triton`), else `per_token_quant_torch`."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x2):
        from pagedllm.kernels.fp8_triton import per_token_quant_triton

        return Fp8Rows(*per_token_quant_triton(x2), x.dtype)
    return Fp8Rows(*per_token_quant_torch(x2), x.dtype)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 on CUDA: x quantized per token by its own kernel, then `fp8_rows_linear`."""
    return fp8_rows_linear(fp8_rows(x), weight, weight_scale, bias)


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ bias) with an FP8 weight; x [M, K] -> [M, N]. On CUDA: the Triton W8A16
    kernel for few rows, cuBLAS W8A8 from SCALED_MM_MIN_ROWS rows (per-channel scales, 16-bit
    activations; `Fp8Rows` are multiplied as they are). Elsewhere the W8A16 reference (the CPU's
    emulation)."""
    if isinstance(x, Fp8Rows):
        return fp8_rows_linear(x, weight, weight_scale, bias)
    if use_triton(x):
        if takes_fp8_rows(x, weight_scale):
            return _scaled_mm(x, weight, weight_scale, bias)
        from pagedllm.kernels.fp8_triton import fp8_gemm_triton

        return fp8_gemm_triton(x, weight, weight_scale, bias)
    if x.device.type == "cpu":
        # the CPU's emulation: dequantize to x's dtype and use its GEMM (same values as the
        # reference up to float32 summation order)
        return torch.nn.functional.linear(x, dequantize_fp8_torch(weight, weight_scale, x.dtype), bias)
    return fp8_linear_torch(x, weight, weight_scale, bias)
