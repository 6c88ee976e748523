"""The MoE experts for a few tokens (decode at small batch): two Triton kernels, no alignment of
the pairs by expert and no separate sum over k; they must equal fused_experts_torch
(fused_moe.py) as the grouped path of fused_moe_triton.py does.

At batch 1 the experts are a weight read (Qwen3-30B-A3B: 8 experts x 9 MiB per layer), and the
grouped path spends as long again on its alignment, its 16-row tiles and its sum. Here each
product is "swap-AB" on the tensor cores: the weight tile is the wide operand and the one
activation row, padded to 16 columns of zeros, the narrow one (a CUDA-core GEMV reads bf16 more
slowly, benchmarks/RESULTS.md, "FP8 kernels and the MoE small-batch path"):

    acc[BLOCK_N, 16] = W[n tile, k tile] @ [x_k | 0 ... 0]      column 0 is the product

- `_small_gate_up_kernel`, program (pair, n tile of I): its expert's gate and up tiles against
  its token's row; writes h[pair] = silu(gate) * up, rounded as the reference. The programs of
  n tile 0 also count the pair in expert_load (padding tokens, slot -1, are not counted).
- `_small_down_kernel`, program (token, n tile of H, group of the token's experts): one loop
  over the group's experts and the I tiles of each (flattened, so the weight loads stay
  pipelined across them); after an expert's last tile its product is rounded and times the
  routing weight, rounded. At one expert a group (the default) a token's down projection is
  k x H / BLOCK_N programs, not H / BLOCK_N: at 1 token one program an n tile walked 8 experts x
  768 serially on 128 programs and read 1.5 TB/s (16.4 us). The k products of a (token, n tile)
  are then added by the last of its programs to finish ("last program reduces"):

      program (t, n, g): y[pair, n tile] -> part        (model dtype, already rounded)
                         barrier; old = atomic_add(count[t, n], 1)   acq_rel, gpu scope
                         if old == groups - 1:  out[t, n tile] = sum over k of part, in top-k
                                                order; count[t, n] = 0 for the next call

  Deterministic: the sum is always the same order, whichever program is last. The counters
  persist (kernels/counters.py), zero between calls. With one group (experts per program >= k) a
  program adds the token's products itself and writes out, with no workspace or counter.
  Pairs of experts on other ranks (expert_map -1) load nothing, add zero and still count.
  The k products are added in top-k order, rounded to the model dtype after each add as
  combine_in_expert_order does (its order is by expert id; the GEMMs' own accumulation orders
  differ from cuBLAS's anyway, so neither path is bit-exact).

Everything is sized from the shapes: CUDA graphs capture it (the counters, allocated by the first
call, are best allocated before a capture, as a warm-up call does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import env_flag, next_power_of_2, pdl, shape_configs, stages_for
from pagedllm.kernels.attention import _dot_precision
from pagedllm.kernels.counters import counters
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait

# (token, expert) pairs up to which fused_experts_triton takes this path: 4 tokens of
# Qwen3-30B-A3B's top-8. H200 sweep (RESULTS.md, eleventh session, call 5), us per layer, this
# path at the sweep's best tiles (the defaults below, but for gate/up at 2 tokens: 0.5 us apart)
# against the grouped path: 1 token 25.1 vs 34.1, 2: 44.6 vs 52.6, 4: 70.9 vs 80.4; at 8 tokens
# (64 pairs) 125.0 vs 128.0, too close to move the bound.
SMALL_MAX_PAIRS = 32
# the activation rows padded to the narrow MMA operand's 16 columns
_PAD_COLS = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel for 16-bit models, and the down
# kernel's experts per program: the bests of the H200 sweep at Qwen3-30B-A3B's experts
# (`moe_bench.py --small-sweep`, RESULTS.md eleventh session, call 5). gate/up 14.5 us at 1 token
# (3.46 TB/s), within 2% of the best at 2 to 8. down at 1 token one expert a program, 64-wide
# tiles: 10.1 us (the serial kernel 17.3); from 2 tokens the serial kernel (every expert of a
# token in one program) wins: 17.8 / 24.6 / 45.5 us at 2 / 4 / 8 tokens against 18.4 / 29.2 /
# 52.1 split. Both kernels at 1 token: 25.1 us a layer, the grouped path 34.1.
DEFAULT_GATE_UP = (64, 128, 4, 4)
DEFAULT_DOWN_ONE_TOKEN = (64, 128, 4, 3, 1)
DEFAULT_DOWN = (16, 256, 1, 4, 8)
# float32 operands take twice the shared memory a stage: narrower gate/up tiles, one stage less
FP32_GATE_UP = (32, 128, 4, 3)
FP32_DOWN = (16, 256, 1, 3, 1)


def default_tiles(dtype: torch.dtype, num_tokens: int = 1) -> tuple[tuple, tuple]:
    """(gate/up tiles, down tiles) for `num_tokens` activation rows of `dtype`."""
    if dtype == torch.float32:
        return FP32_GATE_UP, FP32_DOWN
    return DEFAULT_GATE_UP, DEFAULT_DOWN_ONE_TOKEN if num_tokens == 1 else DEFAULT_DOWN


def _valid_tiles(c: tuple) -> bool:
    block_n, block_k, warps, stages = c[:4]
    return (all(b >= 16 and next_power_of_2(b) == b for b in (block_n, block_k)) and warps in (1, 2, 4, 8)
            and 1 <= stages <= 6 and all(e >= 1 for e in c[4:]))


@functools.cache
def tile_overrides() -> tuple[dict, dict]:
    """PAGEDLLM_MOE_GATE_UP_CONFIG ("N,K:block_n,block_k,warps,stages", N = 2 x the experts'
    intermediate size, K the hidden size) and PAGEDLLM_MOE_DOWN_CONFIG ("N,K:block_n,block_k,warps,
    stages,experts a program", N the hidden size, K the intermediate one), entries separated by ";"
    (read once): the small kernels' tiles at those shapes in place of default_tiles', at every token
    count -- for A/B runs of whole decode steps, where PDL and the kernels around them change what a
    tile costs (the sweeps time each kernel alone). Unset, none; anything else a ValueError naming the
    variable."""
    return (shape_configs("PAGEDLLM_MOE_GATE_UP_CONFIG", "block_n,block_k,warps,stages", _valid_tiles),
            shape_configs("PAGEDLLM_MOE_DOWN_CONFIG", "block_n,block_k,warps,stages,experts", _valid_tiles))


def tiles_for(kernel: int, dtype: torch.dtype, num_tokens: int, w: torch.Tensor) -> tuple:
    """The tiles of kernel 0 (gate/up, w13 [E, 2I, H]) or 1 (down, w2 [E, H, I]) at its weight's shape:
    tile_overrides' where they name it, else default_tiles'."""
    return tile_overrides()[kernel].get(tuple(w.shape[1:]), default_tiles(dtype, num_tokens)[kernel])


@triton.jit
def _small_gate_up_kernel(
    x_ptr,  # [T, hidden]
    w13_ptr,  # [E_local, 2 * inter, hidden]
    h_ptr,  # [P, inter] silu(gate) * up of each pair
    topk_ids_ptr,  # [P] global expert ids
    expert_map_ptr,  # [E_global] local id or -1 (read if HAS_MAP)
    expert_load_ptr,  # [E_global] int64 counters (written if HAS_LOAD)
    slot_mapping_ptr,  # [T] (read if HAS_SLOTS): tokens of slot -1 are not counted
    inter, hidden, top_k,
    stride_xm, stride_we, stride_wn, stride_hm,
    HAS_MAP: tl.constexpr, HAS_LOAD: tl.constexpr, HAS_SLOTS: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAD_COLS: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py (the weights' addresses need the routing)
    RELEASE_LATE: tl.constexpr = False,  # the next kernel released after the wait: the routing is then
    # written when it starts (the down kernel's PRELOAD reads it before its own wait)
):  # fmt: skip
    if RELEASE_LATE:
        pdl_wait(PDL)
        pdl_release(PDL)
    else:
        pdl_release(PDL)
        pdl_wait(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // top_k
    g = tl.load(topk_ids_ptr + pair)
    if HAS_LOAD:
        counted = pid_n == 0
        if HAS_SLOTS:
            counted = counted & (tl.load(slot_mapping_ptr + token) >= 0)
        tl.atomic_add(expert_load_ptr + g, tl.full([], 1, tl.int64), mask=counted)
    if HAS_MAP:
        e = tl.load(expert_map_ptr + g)
    else:
        e = g
    if e < 0:  # another rank's expert: its row of h is never read
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < inter
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, PAD_COLS)
    col0 = (rc == 0)[None, :]  # [1, PAD_COLS]
    gate_rows = w13_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_wn
    # [1, PAD_COLS]: the token's row in column 0, masked rows after it in the others (loaded as
    # the MMA operand itself, so that the loads are pipelined with the weights')
    x_cols = x_ptr + (token.to(tl.int64) + rc[None, :]) * stride_xm
    acc_gate = tl.zeros([BLOCK_N, PAD_COLS], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, PAD_COLS], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w_mask = n_mask[:, None]
            xt = tl.load(x_cols + kk[:, None], mask=col0, other=0.0)  # [BLOCK_K, PAD_COLS]
        else:
            w_mask = n_mask[:, None] & (kk < hidden)[None, :]
            xt = tl.load(x_cols + kk[:, None], mask=col0 & (kk < hidden)[:, None], other=0.0)
        w_gate = tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
        acc_gate = tl.dot(w_gate, xt, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
    dtype = h_ptr.dtype.element_ty
    # the other columns are exact zeros, so the row sums are column 0
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    # rounded like the reference: gate and up in the model dtype, silu rounded, then the product
    s = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + rn, (s * up).to(dtype), mask=n_mask)


@triton.jit
def _k_mask(experts, ko, k, kk, inter, EVEN_K: tl.constexpr):
    """(the local id of the group's expert k, [BLOCK_K] mask of its inputs kk: none for an expert of
    another rank, -1; a vector compare: the interpreter cannot mask with a scalar bool broadcast)."""
    e = tl.sum(tl.where(ko == k, experts, 0), axis=0)
    k_mask = (tl.zeros_like(kk) + e) >= 0
    if not EVEN_K:
        k_mask = k_mask & (kk < inter)
    return e, k_mask


@triton.jit
def _down_tile(w_rows, experts, ko, k, kk, n_mask, inter, stride_we, EVEN_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] of the group's expert k at inputs kk (zeros off this rank)."""
    e, k_mask = _k_mask(experts, ko, k, kk, inter, EVEN_K)
    return tl.load(w_rows + tl.maximum(e, 0).to(tl.int64) * stride_we + kk[None, :],
                   mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip


@triton.jit
def _down_step(acc, w, h_ptr, pair, experts, ko, k, kk, rc, col0, inter, stride_hm, EVEN_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr):  # fmt: skip
    """acc + weight tile w against the pair's row of h at inputs kk ([BLOCK_K, PAD_COLS], the row in
    column 0, as x in the gate/up kernel)."""
    _, k_mask = _k_mask(experts, ko, k, kk, inter, EVEN_K)
    h_cols = h_ptr + (pair.to(tl.int64) + rc[None, :]) * stride_hm
    ht = tl.load(h_cols + kk[:, None], mask=col0 & k_mask[:, None], other=0.0)
    return tl.dot(w, ht, acc, input_precision=DOT_PRECISION)


@triton.jit
def _expert_done(acc, total, weights, ko, k, last, part_ptr, pair, stride_pm, rn, n_mask, SPLIT: tl.constexpr,
                 dtype: tl.constexpr):  # fmt: skip
    """(total, acc) after a tile of the group's expert k: where it was the expert's last (last), the
    rounded product times the routing weight, rounded (an expert of another rank loaded zeros: its
    product is 0), stored for the reduction (SPLIT: a vector mask) or added to total in top-k order,
    rounded after each add; acc then zero."""
    wk = tl.sum(tl.where(ko == k, weights, 0.0), axis=0)
    y = (acc.to(dtype).to(tl.float32) * wk).to(dtype).to(tl.float32)
    if SPLIT:
        last_n = n_mask & ((tl.zeros_like(rn) + last.to(tl.int32)) != 0)
        tl.store(part_ptr + pair.to(tl.int64) * stride_pm + rn, tl.sum(y, axis=1).to(dtype), mask=last_n)
    else:
        total = tl.where(last, (total + y).to(dtype).to(tl.float32), total)
    return total, tl.where(last, 0.0, acc)


@triton.jit
def _small_down_kernel(
    h_ptr,  # [P, inter]
    w2_ptr,  # [E_local, hidden, inter]
    out_ptr,  # [T, hidden]
    part_ptr,  # [P, hidden] each pair's weighted product, model dtype (if SPLIT)
    count_ptr,  # [T * cdiv(hidden, BLOCK_N)] int32, zero between calls (if SPLIT)
    topk_ids_ptr,  # [P] global expert ids
    topk_weights_ptr,  # [P] float32
    expert_map_ptr,  # [E_global] (read if HAS_MAP)
    hidden, inter, top_k,
    stride_hm, stride_we, stride_wn, stride_om, stride_pm,
    HAS_MAP: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    EXPERTS_PER_PROGRAM: tl.constexpr, BLOCK_EXPERTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAD_COLS: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
    PRELOAD: tl.constexpr = False,  # (one expert a program, after a RELEASE_LATE gate/up kernel) the
    # routing and the expert's first weight tile read before the wait, that tile's product added last
):  # fmt: skip
    pdl_release(PDL)
    if not PRELOAD:
        pdl_wait(PDL)
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < hidden
    rk = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, PAD_COLS)
    col0 = (rc == 0)[None, :]
    w_rows = w2_ptr + rn.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    dtype = out_ptr.dtype.element_ty
    # [BLOCK_N, PAD_COLS] like the products: the epilogue stays in the MMA layout (columns
    # 1.. hold zeros through it), reduced to column 0 once at the end
    total = tl.zeros([BLOCK_N, PAD_COLS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, PAD_COLS], dtype=tl.float32)
    # this program's experts (local ids, -1 off this rank) and weights, read once: picked out of
    # registers in the loop, the weight loads' addresses depend on no load in it, so the
    # pipeliner gives them all num_stages - 1 buffers (loaded there, a chain id -> map -> weights
    # took two of the stages, leaving the weight tiles one buffer)
    first = pid_k * EXPERTS_PER_PROGRAM
    group_size = tl.minimum(top_k - first, EXPERTS_PER_PROGRAM)  # the last group may be short
    ko = tl.arange(0, BLOCK_EXPERTS)
    k_valid = ko < group_size
    # (PRELOAD: read before the wait, through the L2, where the router's finished stores are)
    ids = tl.load(topk_ids_ptr + token * top_k + first + ko, mask=k_valid, other=0,
                  cache_modifier=".cg" if PRELOAD else "")  # fmt: skip
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=k_valid, other=-1)
    experts = tl.where(k_valid, ids, -1).to(tl.int64)
    weights = tl.load(topk_weights_ptr + token * top_k + first + ko, mask=k_valid, other=0.0,
                      cache_modifier=".cg" if PRELOAD else "")  # fmt: skip
    num_k = tl.cdiv(inter, BLOCK_K)
    if PRELOAD:  # the expert's first weight tile (a weight: rule 1 of pdl_triton.py), then the wait
        w_first = _down_tile(w_rows, experts, ko, 0, rk, n_mask, inter, stride_we, EVEN_K)
        pdl_wait(PDL)
    for it in range(1 if PRELOAD else 0, group_size * num_k):
        k = it // num_k
        k0 = (it % num_k) * BLOCK_K
        w = _down_tile(w_rows, experts, ko, k, k0 + rk, n_mask, inter, stride_we, EVEN_K)
        acc = _down_step(acc, w, h_ptr, token * top_k + first + k, experts, ko, k, k0 + rk, rc, col0, inter,
                         stride_hm, EVEN_K, DOT_PRECISION)  # fmt: skip
        if not PRELOAD:  # (PRELOAD: one expert, finished after the loop)
            total, acc = _expert_done(acc, total, weights, ko, k, it % num_k == num_k - 1, part_ptr,
                                      token * top_k + first + k, stride_pm, rn, n_mask, SPLIT, dtype)  # fmt: skip
    if PRELOAD:
        acc = _down_step(acc, w_first, h_ptr, token * top_k + first, experts, ko, 0, rk, rc, col0, inter, stride_hm,
                         EVEN_K, DOT_PRECISION)  # fmt: skip
        total, acc = _expert_done(acc, total, weights, ko, 0, tl.full([], 1, tl.int1), part_ptr, token * top_k + first,
                                  stride_pm, rn, n_mask, SPLIT, dtype)  # fmt: skip
    if SPLIT:
        # the last of the token's programs on this n tile adds the k products; every thread's
        # stores come before the barrier, the barrier before the count, whose release publishes
        # them at gpu scope (and whose acquire, in the last program, orders the loads after it)
        tl.debug_barrier()
        counter = count_ptr + token * tl.num_programs(1) + pid_n
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(2) - 1:
            out = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k in range(0, top_k):
                row = part_ptr + (token * top_k + k).to(tl.int64) * stride_pm + rn
                # .cg: from the L2, where the other programs' stores are (never a stale L1 line)
                out = (out + tl.load(row, mask=n_mask, cache_modifier=".cg").to(tl.float32)).to(dtype).to(tl.float32)
            tl.store(out_ptr + token.to(tl.int64) * stride_om + rn, out.to(dtype), mask=n_mask)
            tl.store(counter, 0)  # zero again for the next call (or graph replay)
    else:
        tl.store(out_ptr + token.to(tl.int64) * stride_om + rn, tl.sum(total, axis=1).to(dtype), mask=n_mask)


def small_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    expert_load: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    tiles: tuple | None = None,
    release_late: bool = False,
) -> torch.Tensor:
    # x: [T, H]; w13: [E, 2I, H]; topk_ids: [T, K] -> h [T * K, I] (rows of other ranks' pairs unset);
    # release_late: (PDL) the next kernel released only after this one's wait (small_down's preload)
    num_tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    hidden = x.shape[1]
    block_n, block_k, num_warps, num_stages = tiles or tiles_for(0, x.dtype, num_tokens, w13)
    assert w13.stride(2) == 1 and x.stride(1) == 1
    h = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    flat = topk_ids.reshape(-1)
    _small_gate_up_kernel[(flat.numel(), triton.cdiv(inter, block_n))](
        x, w13, h, flat, expert_map if expert_map is not None else flat,
        expert_load if expert_load is not None else flat, slot_mapping if slot_mapping is not None else flat,
        inter, hidden, top_k, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        HAS_MAP=expert_map is not None, HAS_LOAD=expert_load is not None, HAS_SLOTS=slot_mapping is not None,
        EVEN_K=hidden % block_k == 0, DOT_PRECISION=_dot_precision(x.dtype), BLOCK_N=block_n, BLOCK_K=block_k,
        PAD_COLS=_PAD_COLS, num_warps=num_warps, RELEASE_LATE=release_late, **pdl(x),
        num_stages=stages_for(x.device, num_stages, stage_bytes(block_n, block_k, 2 * w13.element_size(),
                                                                 x.element_size())),
    )  # fmt: skip
    return h


def stage_bytes(block_n: int, block_k: int, w_size: int, x_size: int) -> int:
    """The shared memory one pipeline stage of the small kernels holds: the weight tile (gate/up: w_size
    covers both of its rows' bytes) and the activations' padded one."""
    return block_k * (block_n * w_size + _PAD_COLS * x_size)


def experts_per_program(tiles: tuple, top_k: int) -> int:
    """The down kernel's experts a program for its tiles (BLOCK_N, BLOCK_K, num_warps, num_stages[,
    experts a program]): 1 unless given, at most top_k."""
    return min(tiles[4] if len(tiles) > 4 else 1, top_k)


def small_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    tiles: tuple | None = None,
    preload: bool = False,
) -> torch.Tensor:
    """h: [T * K, I]; w2: [E, H, I]; topk_*: [T, K] -> [T, H], the weighted sum over k.
    tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages[, experts per program]); experts per
    program 1 if not given, top_k or more: one program per (token, n tile) adds them all itself
    (no workspace, no counters). preload (one expert a program): the routing and each program's
    first weight tile read before the PDL wait -- only right after small_gate_up(release_late=True)
    on the same routing."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    tiles = tiles or tiles_for(1, h.dtype, num_tokens, w2)
    block_n, block_k, num_warps, num_stages = tiles[:4]
    per_program = experts_per_program(tiles, top_k)
    assert not preload or per_program == 1, "the down kernel's preload takes one expert a program"
    num_groups = triton.cdiv(top_k, per_program)
    num_n = triton.cdiv(hidden, block_n)
    assert w2.stride(2) == 1
    out = torch.empty((num_tokens, hidden), dtype=h.dtype, device=h.device)
    split = num_groups > 1
    # [T * K, H]: each pair's rounded, weighted product (none if not split)
    part = torch.empty((num_tokens * top_k if split else 0, hidden), dtype=h.dtype, device=h.device)
    counts = counters(h.device, num_tokens * num_n) if split else out
    flat = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1).to(torch.float32)
    _small_down_kernel[(num_tokens, num_n, num_groups)](
        h, w2, out, part, counts, flat, weights, expert_map if expert_map is not None else flat,
        hidden, inter, top_k, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), part.stride(0),
        HAS_MAP=expert_map is not None, EVEN_K=inter % block_k == 0, DOT_PRECISION=_dot_precision(h.dtype),
        SPLIT=split, EXPERTS_PER_PROGRAM=per_program, BLOCK_EXPERTS=next_power_of_2(per_program),
        BLOCK_N=block_n, BLOCK_K=block_k, PAD_COLS=_PAD_COLS, num_warps=num_warps, PRELOAD=preload, **pdl(h),
        num_stages=stages_for(h.device, num_stages, stage_bytes(block_n, block_k, w2.element_size(),
                                                                 h.element_size())),
    )  # fmt: skip
    return out


def fused_experts_small(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    expert_load: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    gate_up_tiles: tuple | None = None,
    down_tiles: tuple | None = None,
) -> torch.Tensor:
    """fused_experts_triton's result for a few tokens: x [T, H], topk_*: [T, K] -> [T, H].
    *_tiles: (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel (None: tiles_for's)."""
    if topk_ids.shape[0] == 0:
        return x.new_zeros((0, w2.shape[1]))
    x = x if x.stride(-1) == 1 else x.contiguous()
    down_tiles = down_tiles or tiles_for(1, x.dtype, topk_ids.shape[0], w2)
    preload = down_preload() and experts_per_program(down_tiles, topk_ids.shape[1]) == 1
    h = small_gate_up(x, w13, topk_ids, expert_map, expert_load, slot_mapping, gate_up_tiles, release_late=preload)
    return small_down(h, w2, topk_weights, topk_ids, expert_map, down_tiles, preload=preload)


@functools.cache
def down_preload() -> bool:
    """PAGEDLLM_MOE_PRELOAD (read once; on by default, 0 off): where the down kernel runs one expert a
    program (1 token, the default tiles), the gate/up kernel releases it only after its own PDL wait
    (the routing then written), and it reads the routing and its expert's first weight tile before
    its wait, adding that tile's product after its loop. Qwen3-30B-A3B batch 1 on the H100
    (twenty-sixth session, two rounds rotated): 3.349 / 3.346 -> 3.278 / 3.309 ms/token. The
    fourteenth session's L2 prefetch of the whole rows (25 MB a layer) lost 0.2 ms a token; this
    holds one tile a program in registers, bytes the kernel reads anyway. Without PDL (the
    interpreter, PAGEDLLM_PDL=0) the same structure runs, so the sums do not depend on PDL."""
    return env_flag("PAGEDLLM_MOE_PRELOAD", default=True)
