"""The swap-AB tensor-core GEMM for few rows (1-16), shared by the FP8 W8A16 path (fp8_triton.py)
and the 16-bit dense path (small_m.py); each caller's torch reference is beside its dispatcher.

With at most 16 rows, a [16, BLOCK_K] x [BLOCK_K, BLOCK_N] product would spend most MMA lanes
on absent rows. The operands are swapped (out.T = W @ x.T) so the weight is the wide operand:

      acc [BLOCK_N, 16] += W tile [BLOCK_N, BLOCK_K] @ x.T tile [BLOCK_K, 16]

x.T's columns past M are masked loads of 0. Two operand kinds (OPERANDS):
  "fp16": e4m3 weights, converted to fp16 in registers (one `cvt.rn.f16x2.e4m3x2` per two values
          on sm_89+; e4m3 -> bf16 would go through float32), and 16-bit x as fp16 (bf16 values
          beyond fp16's range saturate at +-65504);
  "weight": 16-bit weights used as they are, x converted to the weight's dtype (the same dtype
          on the dense path: no conversion at all);
  "fp32": float32 x (the FP8 path on float32 models): float32 operands, ieee precision.
Scales (SCALED, FP8 only): GROUP_K = 0 multiplies the finished sum by the row's scale, GROUP_K > 0
multiplies each K tile's partial by its group's scale (BLOCK_K divides GROUP_K).

Split-K: SPLIT_K programs per N tile each sum a range of K. Two ways to add their partials:

    workspace (default):  split i stores float32 [M, N] at ws[i]; `_splitk_reduce_kernel` sums the
                          splits in a fixed order and applies the epilogue (deterministic)
    ATOMIC:               each split adds its partial into a zeroed float32 [M, N] with float32
                          atomics (split 0 adds the bias); a 16-bit output is then one cast.
                          The order of the adds varies from run to run (not bitwise repeatable).

Both are CUDA-graph capturable: no host synchronization, buffers from the caching allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# the padded row count (the narrow MMA operand): the kernel serves at most this many rows
SWAP_BLOCK_M = 16
FP16_MAX = 65504.0


@dataclass(frozen=True, slots=True)
class SwapConfig:
    """One launch configuration of the swap-AB kernel."""

    block_n: int  # weight rows (output features) per program: the MMA's M side
    block_k: int  # K per loop iteration
    split_k: int = 1  # programs per N tile, each over a range of K
    num_warps: int = 4
    num_stages: int = 3
    atomic: bool = False  # split-K partials added with float32 atomics instead of a workspace


@triton.jit
def _swap_kernel(
    x_ptr,  # [M, K] activations, M <= BLOCK_M
    w_ptr,  # [N, K] float8 e4m3 (SCALED) or 16-bit
    s_ptr,  # [N, G] float32 scales (read when SCALED)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1, or float32 zeros when ATOMIC) or the float32 workspace [SPLIT_K, M, N]
    M, N, K, K_SPLIT,  # K_SPLIT: the K range of one split, a multiple of BLOCK_K
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    OPERANDS: tl.constexpr,  # "fp16", "weight" or "fp32" (the module docstring)
    FP16_MAX_: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn64[:, None] * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]: x.T's columns
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = pid_k * K_SPLIT
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :], other=0.0)
        else:
            k_mask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_cols + kk[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        if OPERANDS == "fp16":
            w = w.to(tl.float16)
            if xt.dtype != tl.float16:
                xt = tl.clamp(xt.to(tl.float32), -FP16_MAX_, FP16_MAX_).to(tl.float16)
            part = tl.dot(w, xt)
        elif OPERANDS == "weight":
            part = tl.dot(w, xt.to(w.dtype))
        else:
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        if SCALED and GROUP_K > 0:
            s = tl.load(s_ptr + rn64 * stride_sn + k0 // GROUP_K, mask=n_mask, other=0.0)
            acc += part * s[:, None]
        else:
            acc += part
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1 or ATOMIC:
        if SCALED and GROUP_K == 0:  # linear, so each split may scale its own partial
            acc = acc * tl.load(s_ptr + rn64 * stride_sn, mask=n_mask, other=0.0)[:, None]
        if HAS_BIAS:  # once: split 0 adds it (the others load nothing)
            b_mask = rn < tl.where(pid_k == 0, N, 0)
            acc = acc + tl.load(b_ptr + rn, mask=b_mask, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + rm[None, :] * stride_om + rn[:, None]
        if SPLIT_K == 1:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.atomic_add(out, acc, mask=out_mask, sem="relaxed")
    else:
        ws = out_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None]
        tl.store(ws, acc, mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,  # [SPLIT_K, M, N] float32 partial sums
    s_ptr, b_ptr, out_ptr,  # scales [N, G] (read when SCALED), bias [N], out [M, N]
    M, N, stride_sn, stride_om,
    SPLIT_K: tl.constexpr, SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (i * M + m) * N + rn, mask=mask, other=0.0)
    if SCALED and GROUP_K == 0:
        acc = acc * tl.load(s_ptr + rn.to(tl.int64) * stride_sn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def swap_gemm(
    x: torch.Tensor,  # [M, K], M <= SWAP_BLOCK_M, unit stride along K
    weight: torch.Tensor,  # [N, K] e4m3 (with weight_scale) or 16-bit, unit stride along K
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N], unit stride along N: written
    cfg: SwapConfig,
    weight_scale: torch.Tensor | None = None,  # [N, G] float32: e4m3 weights
    group_k: int = 0,  # with weight_scale: 0 (one scale a row) or the K width of a scale group
) -> None:
    m, k = x.shape
    n = weight.shape[0]
    assert m <= SWAP_BLOCK_M, f"the swap-AB kernel takes at most {SWAP_BLOCK_M} rows"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1 and out.stride(1) == 1
    block_k = cfg.block_k
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_split)  # no empty split
    scaled = weight_scale is not None
    if scaled:
        operands = "fp32" if x.dtype == torch.float32 else "fp16"
    else:
        assert weight.dtype in (torch.bfloat16, torch.float16), "an unscaled weight must be 16-bit"
        operands = "weight"
    s = weight_scale if scaled else weight  # an unused pointer when not SCALED
    b = bias if bias is not None else s  # likewise when there is no bias
    atomic = cfg.atomic and split_k > 1
    if split_k == 1:
        dst = out
    elif atomic:
        dst = out.zero_() if out.dtype == torch.float32 else torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        dst = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _swap_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x, weight, s, b, dst, m, n, k, k_split,
        x.stride(0), weight.stride(0), s.stride(0), dst.stride(0) if atomic else out.stride(0),
        SCALED=scaled, GROUP_K=group_k, HAS_BIAS=bias is not None, EVEN_K=k_split * split_k == k,
        SPLIT_K=split_k, ATOMIC=atomic, BLOCK_M=SWAP_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        OPERANDS=operands, FP16_MAX_=FP16_MAX, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if atomic:
        if dst is not out:
            out.copy_(dst)
    elif split_k > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            dst, s, b, out, m, n, s.stride(0), out.stride(0),
            SPLIT_K=split_k, SCALED=scaled, GROUP_K=group_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
