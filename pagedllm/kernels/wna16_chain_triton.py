"""A decoder layer's MLP of 4-bit weights at one row in one persistent launch (`wna16_mlp_chain`):
gate_up (gemvp, kernels/wna16_gemv_triton.py), SiLU-and-mul and down -- three kernels at a decode step
of batch 1 -- as two stages of one kernel with a grid barrier between them (kernels/grid_triton.py);
optionally the o projection, the residual add and the RMSNorm before them too (five kernels in one).
Must equal o_proj -> fused_add_rms_norm -> gate_up -> silu_and_mul -> down up to the order of the
float32 sums.

Why: at one row every projection only streams its words, and a chain of short kernels loses
bandwidth at every boundary -- a kernel's ramp and drain, the next one's launch. Streaming
Llama-3.1-8B's four int4 projections x 32 layers on the H100 (`benchmarks/stream_bench.py
--persistent`): one kernel a projection 1.387 ms a step, one persistent kernel 1.157 ms without
barriers and 1.284 with one between projections (twenty-ninth session). Here a program that is done
with a stage loads its first tile of the next stage's words before it waits, and the SiLU-and-mul and
RMSNorm kernels are gone: a gate_up unit is BLOCK_N_GU gate columns and the same up columns (one tile
of 2 * BLOCK_N_GU), whose epilogue writes silu(gate) * up itself; the last program done with o adds
the residual and norms the row (the norm kernel's arithmetic, norm_triton.add_rms_norm_row) while
the others wait with their first gate_up tile loaded.

Stages: o (HAS_O), gate_up, down; each in units of columns, unit j to program j mod P, over the whole
K (no split-K). P is a few programs an SM (DEFAULT_CONFIG), all resident at once -- a barrier needs
every program running: their register cap (ptxas maxnreg) leaves room for as many an SM, and they use
little shared memory. STAGE -1 runs every stage with the barriers; 0 / 1 / 2 one stage (a launch each:
the interpreter, whose programs run one after another, and the GPU tests' reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import inline_ptx, num_sms, pdl
from pagedllm.kernels.activation_triton import silu_mul
from pagedllm.kernels.counters import counters
from pagedllm.kernels.grid_triton import grid_arrive, grid_reset
from pagedllm.kernels.norm_triton import add_rms_norm_row
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.wna16 import group_width
from pagedllm.kernels.wna16_gemv_triton import _gemvp_acc

# (BLOCK_N_GU, BLOCK_KW_GU, BLOCK_N_D, BLOCK_KW_D, num_warps, programs an SM[, BLOCK_N_O, BLOCK_KW_O: down's
# unless given]): gate_up in tiles of 16 + 16
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
def _gemv_units(x_row, w_ptr, s_ptr, z_ptr, out_ptr, N, KW, stride_w, stride_s, bar_ptr, bar_target, pid, programs,
                GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                ASM: tl.constexpr, PDL: tl.constexpr, KPERM: tl.constexpr, BARRIER: tl.constexpr,
                X_CACHE: tl.constexpr):  # fmt: skip
    """A projection's outputs [N] in units of BLOCK_N columns, unit j to program j mod programs; with
    BARRIER the program's first unit waits at the grid barrier (bar_ptr, bar_target) after its first
    tile's words are loaded, the later units do not wait."""
    rd = tl.arange(0, BLOCK_N)
    for j in range(pid, tl.cdiv(N, BLOCK_N), programs):
        rn = j * BLOCK_N + rd
        n_mask = rn < N
        wait = tl.where(j == pid, bar_target, 0)
        acc = _gemvp_acc(x_row, w_ptr, s_ptr, z_ptr, rn, n_mask, 0, KW, stride_w, stride_s, bar_ptr, wait, GROUP,
                         HAS_ZERO, KW % BLOCK_KW == 0, BLOCK_KW, ASM, PDL, True, 1, KPERM, BARRIER=BARRIER,
                         X_CACHE=X_CACHE)  # fmt: skip
        y = _channel_sums(acc, s_ptr, rn, n_mask, GROUP)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _mlp_chain_kernel(
    x_ptr,  # [K] the input row, 16-bit: the MLP's (HAS_O False) or the attention's output (HAS_O)
    ow_ptr, os_ptr, oz_ptr,  # (HAS_O) o: words [K / 8, H], scales / zeros [G, H]
    res_ptr, nw_ptr, eps,  # (HAS_O) the residual [H] the o output is added to, the RMSNorm's weight [H]
    obuf_ptr, xn_ptr, res_out_ptr,  # (HAS_O) o's output [H], the normed row [H], o + residual [H]
    gw_ptr, gs_ptr, gz_ptr,  # gate_up: words [H / 8, 2 INTER], scales / zeros [G, 2 INTER]
    dw_ptr, ds_ptr, dz_ptr,  # down: words [INTER / 8, H], scales / zeros [G', H]
    act_ptr,  # [INTER] silu(gate) * up in x's dtype: the gate_up stage writes it, down reads it
    out_ptr,  # [H]
    bar_ptr,  # counters (counters.py, zero between calls): [0] o's programs done, [1] the normed row
    # written, [2] gate_up's programs done, [3] the programs done with the launch
    INTER, H, KW_O, KW_GU, KW_D, stride_ow, stride_os, stride_gw, stride_gs, stride_dw, stride_ds,
    GROUP_O: tl.constexpr, GROUP_GU: tl.constexpr, GROUP_D: tl.constexpr, HAS_ZERO: tl.constexpr,
    BLOCK_N_O: tl.constexpr, BLOCK_KW_O: tl.constexpr, BLOCK_N_GU: tl.constexpr, BLOCK_KW_GU: tl.constexpr,
    BLOCK_N_D: tl.constexpr, BLOCK_KW_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ASM: tl.constexpr, KPERM_O: tl.constexpr, KPERM_GU: tl.constexpr, KPERM_D: tl.constexpr,
    HAS_O: tl.constexpr,  # o, then the residual add + RMSNorm, before gate_up
    STAGE: tl.constexpr,  # -1 every stage, grid barriers between; 0 (o), 1 (gate_up) or 2 (down) alone
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py: the first stage's first tile loads before the wait
):  # fmt: skip
    pdl_release(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    act: tl.constexpr = x_ptr.dtype.element_ty
    ALL: tl.constexpr = STAGE == -1
    if HAS_O and (ALL or STAGE == 0):  # o; the last program done adds the residual and norms the row
        _gemv_units(x_ptr, ow_ptr, os_ptr, oz_ptr, obuf_ptr, H, KW_O, stride_ow, stride_os, bar_ptr, 0, pid, programs,
                    GROUP_O, HAS_ZERO, BLOCK_N_O, BLOCK_KW_O, ASM, PDL, KPERM_O, False, "")  # fmt: skip
        pdl_wait(PDL)  # (a program without units: the kernel before may still use the counters)
        tl.debug_barrier()
        if tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
            cols = tl.arange(0, BLOCK_H)
            mask = cols < H
            o = tl.load(obuf_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg")
            r = tl.load(res_ptr + cols, mask=mask, other=0.0)
            wy, h = add_rms_norm_row(o, r, tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32), H, eps, True)
            tl.store(res_out_ptr + cols, h, mask=mask)
            tl.store(xn_ptr + cols, wy.to(act), mask=mask)
            grid_arrive(bar_ptr + 1)
    if ALL or STAGE == 1:  # gate_up, its epilogue silu(gate) * up
        if HAS_O:
            x_row = xn_ptr
        else:
            x_row = x_ptr
        c = tl.arange(0, 2 * BLOCK_N_GU)
        for j in range(pid, tl.cdiv(INTER, BLOCK_N_GU), programs):
            cols = j * BLOCK_N_GU + c % BLOCK_N_GU
            rn = tl.where(c < BLOCK_N_GU, cols, INTER + cols)  # the unit's gate columns, then its up columns
            n_mask = cols < INTER
            # (after o: the first unit waits for the normed row, its first tile's words loaded)
            acc = _gemvp_acc(x_row, gw_ptr, gs_ptr, gz_ptr, rn, n_mask, 0, KW_GU, stride_gw, stride_gs, bar_ptr + 1,
                             tl.where(j == pid, 1, 0), GROUP_GU, HAS_ZERO, KW_GU % BLOCK_KW_GU == 0, BLOCK_KW_GU, ASM,
                             PDL and not HAS_O, True, 1, KPERM_GU, BARRIER=HAS_O and ALL,
                             X_CACHE=".cg" if HAS_O else "")  # fmt: skip
            y = _channel_sums(acc, gs_ptr, rn, n_mask, GROUP_GU).to(act)  # (gemvp's output dtype)
            gate, up = tl.split(tl.permute(tl.reshape(y, [2, BLOCK_N_GU]), [1, 0]))
            out_cols = j * BLOCK_N_GU + tl.arange(0, BLOCK_N_GU)
            tl.store(act_ptr + out_cols, silu_mul(gate, up), mask=out_cols < INTER)
        if ALL:
            pdl_wait(PDL)  # (as above)
            grid_arrive(bar_ptr + 2)
    if ALL or STAGE == 2:  # down over silu(gate) * up: its first tile's words load before the barrier's wait
        _gemv_units(act_ptr, dw_ptr, ds_ptr, dz_ptr, out_ptr, H, KW_D, stride_dw, stride_ds, bar_ptr + 2,
                    programs, pid, programs, GROUP_D, HAS_ZERO, BLOCK_N_D, BLOCK_KW_D, ASM, False, KPERM_D, ALL,
                    ".cg")  # fmt: skip
    grid_reset(bar_ptr, 3)


def wna16_mlp_chain(
    x: torch.Tensor,  # [1, K] 16-bit: the MLP's input, or with o the attention's output
    gate_up: tuple,  # (qweight [H / 8, 2 I] int32, scales [G, 2 I], zeros or None, kperm)
    down: tuple,  # (qweight [I / 8, H], scales [G', H], zeros or None, kperm)
    config: tuple = DEFAULT_CONFIG,
    stages: bool | None = None,  # one launch a stage (None: under the interpreter)
    asm: bool | None = None,  # None: the PTX word sums on a GPU, Triton ops under the interpreter
    o: tuple | None = None,  # (qweight [K / 8, H], scales, zeros or None, kperm): o, then the norm, first
    residual: torch.Tensor | None = None,  # (with o) [1, H]
    norm: tuple | None = None,  # (with o) the RMSNorm's (weight [H], eps)
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """down(silu(gate) * up) of x, [1, H] in x's dtype; with o, (that of RMSNorm(o(x) + residual), o(x)
    + residual): the decoder layer from the attention's output to the MLP's, as o_proj, the fused
    add + RMSNorm, gate_up, silu_and_mul and down compute it (up to the order of float32 sums)."""
    gw, gs, gz, kperm_gu = gate_up
    dw, ds, dz, kperm_d = down
    ow, os_, oz, kperm_o = o if o is not None else (gw, gs, gz, False)
    i, h, k_gu = gw.shape[1] // 2, dw.shape[1], gw.shape[0] * 8
    assert dw.shape[0] * 8 == i and (gz is None) == (dz is None) == (oz is None)
    assert k_gu == (h if o is not None else x.shape[1])
    assert o is None or (ow.shape == (x.shape[1] // 8, h) and residual is not None and norm is not None)
    assert all(t.stride(1) == 1 for t in (gw, gs, dw, ds, ow, os_))
    bn_gu, bkw_gu, bn_d, bkw_d, warps, per_sm = config[:6]
    bn_o, bkw_o = config[6:8] if len(config) > 6 else (bn_d, bkw_d)
    if any(kp and bkw % 16 for kp, bkw in ((kperm_gu, bkw_gu), (kperm_d, bkw_d), (kperm_o, bkw_o))):
        raise ValueError(f"config {config}: the steps-permuted layout is read in tiles of whole steps (16 words)")
    dev, dt = x.device, x.dtype
    act = torch.empty(i, dtype=dt, device=dev)
    out = torch.empty((1, h), dtype=dt, device=dev)
    units = max(triton.cdiv(i, bn_gu), triton.cdiv(h, bn_d), triton.cdiv(h, bn_o) if o is not None else 1)
    interpret = not x.is_cuda
    programs = min(units, 4 if interpret else per_sm * num_sms(dev))
    if stages is None:
        stages = interpret
    # every program resident at once (the barrier waits for all): per_sm of them fit an SM's registers
    cap = {} if interpret else {"maxnreg": min(255, _REGISTERS_PER_SM // (per_sm * warps * 32) // 8 * 8)}
    common = dict(GROUP_O=group_width(x.shape[1], os_.shape[0], 8), GROUP_GU=group_width(k_gu, gs.shape[0], 8),
                  GROUP_D=group_width(i, ds.shape[0], 8), HAS_ZERO=gz is not None, BLOCK_N_O=bn_o, BLOCK_KW_O=bkw_o,
                  BLOCK_N_GU=bn_gu, BLOCK_KW_GU=bkw_gu, BLOCK_N_D=bn_d, BLOCK_KW_D=bkw_d,
                  BLOCK_H=triton.next_power_of_2(h), ASM=inline_ptx(dev, dt) if asm is None else asm,
                  KPERM_O=kperm_o, KPERM_GU=kperm_gu, KPERM_D=kperm_d, HAS_O=o is not None, num_warps=warps,
                  **cap)  # fmt: skip
    if o is not None:
        obuf, xn, res_out = (torch.empty(h, dtype=dt, device=dev) for _ in range(3))
        nw, eps = norm
        res = residual
    else:
        obuf = xn = res_out = res = nw = act  # (unused pointers)
        eps = 0.0
    bar = counters(dev, 4)
    args = (x, ow, os_, oz if oz is not None else os_, res, nw, eps, obuf, xn, res_out, gw, gs,
            gz if gz is not None else gs, dw, ds, dz if dz is not None else ds, act, out, bar, i, h, ow.shape[0],
            gw.shape[0], dw.shape[0], ow.stride(0), os_.stride(0), gw.stride(0), gs.stride(0), dw.stride(0),
            ds.stride(0))  # fmt: skip
    first = 0 if o is not None else 1
    for stage in range(first, 3) if stages else (-1,):
        _mlp_chain_kernel[(programs,)](*args, STAGE=stage, **common, **(pdl(x) if stage in (-1, first) else {}))
    return out if o is None else (out, res_out.view(1, h))
