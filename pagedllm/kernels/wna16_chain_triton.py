"""A gated MLP of 4-bit weights at one row in one persistent launch (`wna16_mlp_chain`): gate_up
(gemvp, kernels/wna16_gemv_triton.py), SiLU-and-mul, down -- three kernels at a decode step of
batch 1 -- as two stages of one kernel with a grid barrier between them (kernels/grid_triton.py).
Must equal gemvp(gate_up) -> silu_and_mul -> gemvp(down) up to the order of the float32 sums.

Why: at one row every projection only streams its words, and a chain of short kernels loses
bandwidth at every boundary -- a kernel's ramp and drain, the next one's launch. Streaming
Llama-3.1-8B's four int4 projections x 32 layers on the H100 (`benchmarks/stream_bench.py
--persistent`): one kernel a projection 1.387 ms a step, one persistent kernel 1.157 ms without
barriers and 1.284 with one between projections (twenty-ninth session). Here the programs that
finish their gate_up units load their first tile of down's words before they wait, and the
SiLU-and-mul kernel is gone: each gate_up unit is BLOCK_N_GU gate columns and the same up
columns (one tile of 2 * BLOCK_N_GU), whose epilogue writes silu(gate) * up itself.

Stage 0 (gate_up): units of BLOCK_N_GU output pairs, unit j to program j mod P; stage 1 (down):
units of BLOCK_N_D outputs, likewise, each over the whole K (no split-K). P is a few programs an SM
(DEFAULT_CONFIG), all resident at once -- the barrier needs every program running: their register
cap (ptxas maxnreg) leaves room for as many an SM, and they use little shared memory. STAGE -1 runs both stages with the barrier; 0 / 1 one stage (a
launch each: the interpreter, whose programs run one after another, and the GPU test's reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import inline_ptx, num_sms, pdl
from pagedllm.kernels.activation_triton import silu_mul
from pagedllm.kernels.counters import counters
from pagedllm.kernels.grid_triton import grid_arrive, grid_reset
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.wna16 import group_width
from pagedllm.kernels.wna16_gemv_triton import _gemvp_acc

# (BLOCK_N_GU, BLOCK_KW_GU, BLOCK_N_D, BLOCK_KW_D, num_warps, programs an SM): gate_up in tiles of 16 + 16
# columns x 1,024 inputs (gemvp's 32 x 1,024), down 16 columns x 2,048 inputs, two programs an SM. A program
# keeps two tiles of words in flight (gemvp's register prefetch), so an SM streams at the memory's pace
# only with 32-64 KB of them: down's 4,096 outputs make 256 units of 16 for 264 programs (of 32, 128
# units would leave one program an SM at most).
DEFAULT_CONFIG = (16, 128, 16, 256, 8, 2)
_REGISTERS_PER_SM = 65536


@triton.jit
def _channel_sums(acc, s_ptr, rn, n_mask, GROUP_K: tl.constexpr):
    """A unit's outputs in float32: gemvp's partial sums added over their rows, the per-channel scale
    where there are no groups (as _gemv_finish)."""
    y = tl.sum(acc, axis=0)
    if GROUP_K == 0:
        y = y * tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _mlp_chain_kernel(
    x_ptr,  # [K] the MLP's input row, 16-bit (read as int32 pairs)
    gw_ptr, gs_ptr, gz_ptr,  # gate_up: words [K / 8, 2 INTER], scales / zeros [G, 2 INTER]
    dw_ptr, ds_ptr, dz_ptr,  # down: words [INTER / 8, H], scales / zeros [G', H]
    act_ptr,  # [INTER] silu(gate) * up in x's dtype: stage 0 writes it, stage 1 reads it
    out_ptr,  # [H]
    bar_ptr,  # counters (counters.py, zero between calls): [0] the barrier, [1] the programs done
    INTER, H, KW_GU, KW_D, stride_gw, stride_gs, stride_dw, stride_ds,
    GROUP_GU: tl.constexpr, GROUP_D: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_N_GU: tl.constexpr, BLOCK_KW_GU: tl.constexpr, BLOCK_N_D: tl.constexpr, BLOCK_KW_D: tl.constexpr,
    ASM: tl.constexpr, KPERM_GU: tl.constexpr, KPERM_D: tl.constexpr,
    STAGE: tl.constexpr,  # -1 both stages, the grid barrier between; 0 or 1 that stage alone
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py: the first gate_up tile loads before the wait
):  # fmt: skip
    pdl_release(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    act: tl.constexpr = x_ptr.dtype.element_ty
    if STAGE != 1:  # gate_up, its epilogue silu(gate) * up
        c = tl.arange(0, 2 * BLOCK_N_GU)
        for j in range(pid, tl.cdiv(INTER, BLOCK_N_GU), programs):
            cols = j * BLOCK_N_GU + c % BLOCK_N_GU
            rn = tl.where(c < BLOCK_N_GU, cols, INTER + cols)  # the unit's gate columns, then its up columns
            n_mask = cols < INTER
            acc = _gemvp_acc(x_ptr, gw_ptr, gs_ptr, gz_ptr, rn, n_mask, 0, KW_GU, stride_gw, stride_gs, bar_ptr, 0,
                             GROUP_GU, HAS_ZERO, KW_GU % BLOCK_KW_GU == 0, BLOCK_KW_GU, ASM, PDL, True, 1,
                             KPERM_GU)  # fmt: skip
            y = _channel_sums(acc, gs_ptr, rn, n_mask, GROUP_GU).to(act)  # (gemvp's output dtype)
            gate, up = tl.split(tl.permute(tl.reshape(y, [2, BLOCK_N_GU]), [1, 0]))
            out_cols = j * BLOCK_N_GU + tl.arange(0, BLOCK_N_GU)
            tl.store(act_ptr + out_cols, silu_mul(gate, up), mask=out_cols < INTER)
    if STAGE == -1:
        pdl_wait(PDL)  # (a program without gate_up units: the kernel before may still use the counters)
        grid_arrive(bar_ptr)
    if STAGE != 0:  # down over silu(gate) * up: its first tile's words load before the barrier's wait
        rd = tl.arange(0, BLOCK_N_D)
        for j in range(pid, tl.cdiv(H, BLOCK_N_D), programs):
            rn = j * BLOCK_N_D + rd
            n_mask = rn < H
            wait = tl.where(j == pid, programs, 0)  # (the barrier: before the program's first unit only)
            acc = _gemvp_acc(act_ptr, dw_ptr, ds_ptr, dz_ptr, rn, n_mask, 0, KW_D, stride_dw, stride_ds, bar_ptr, wait,
                             GROUP_D, HAS_ZERO, KW_D % BLOCK_KW_D == 0, BLOCK_KW_D, ASM, False, True, 1, KPERM_D,
                             BARRIER=STAGE == -1, X_CACHE=".cg")  # fmt: skip
            y = _channel_sums(acc, ds_ptr, rn, n_mask, GROUP_D)
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    if STAGE == -1:
        grid_reset(bar_ptr, 1)


def wna16_mlp_chain(
    x: torch.Tensor,  # [1, K] 16-bit
    gate_up: tuple,  # (qweight [K / 8, 2 I] int32, scales [G, 2 I], zeros or None, kperm)
    down: tuple,  # (qweight [I / 8, H], scales [G', H], zeros or None, kperm)
    config: tuple = DEFAULT_CONFIG,
    stages: bool | None = None,  # one launch a stage (None: under the interpreter, or where the GPU
    # could not hold every program at once)
    asm: bool | None = None,  # None: the PTX word sums on a GPU, Triton ops under the interpreter
) -> torch.Tensor:  # [1, H] in x's dtype: down(silu(gate) * up)
    gw, gs, gz, kperm_gu = gate_up
    dw, ds, dz, kperm_d = down
    k = x.shape[1]
    i2 = gw.shape[1]
    i, h = i2 // 2, dw.shape[1]
    assert gw.shape[0] * 8 == k and dw.shape[0] * 8 == i and (gz is None) == (dz is None)
    assert gw.stride(1) == 1 and dw.stride(1) == 1 and gs.stride(1) == 1 and ds.stride(1) == 1
    bn_gu, bkw_gu, bn_d, bkw_d, warps, per_sm = config
    if (kperm_gu and bkw_gu % 16) or (kperm_d and bkw_d % 16):
        raise ValueError(f"config {config}: the steps-permuted layout is read in tiles of whole steps (16 words)")
    act = torch.empty(i, dtype=x.dtype, device=x.device)
    out = torch.empty((1, h), dtype=x.dtype, device=x.device)
    units = max(triton.cdiv(i, bn_gu), triton.cdiv(h, bn_d))
    interpret = not x.is_cuda
    programs = min(units, 4 if interpret else per_sm * num_sms(x.device))
    if stages is None:
        stages = interpret
    # every program resident at once (the barrier waits for all): per_sm of them fit an SM's registers
    cap = {} if interpret else {"maxnreg": min(255, _REGISTERS_PER_SM // (per_sm * warps * 32) // 8 * 8)}
    common = dict(GROUP_GU=group_width(k, gs.shape[0], 8), GROUP_D=group_width(i, ds.shape[0], 8),
                  HAS_ZERO=gz is not None, BLOCK_N_GU=bn_gu, BLOCK_KW_GU=bkw_gu, BLOCK_N_D=bn_d, BLOCK_KW_D=bkw_d,
                  ASM=inline_ptx(x.device, x.dtype) if asm is None else asm, KPERM_GU=kperm_gu, KPERM_D=kperm_d,
                  num_warps=warps, **cap)  # fmt: skip
    bar = counters(x.device, 2)
    args = (x, gw, gs, gz if gz is not None else gs, dw, ds, dz if dz is not None else ds, act, out, bar, i, h,
            gw.shape[0], dw.shape[0], gw.stride(0), gs.stride(0), dw.stride(0), ds.stride(0))  # fmt: skip
    for stage in (0, 1) if stages else (-1,):
        _mlp_chain_kernel[(programs,)](*args, STAGE=stage, **common, **(pdl(x) if stage != 1 else {}))
    return out
