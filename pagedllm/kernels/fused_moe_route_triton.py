"""The MoE router and the small gate/up products of a few tokens in one kernel (opt-in,
PAGEDLLM_FUSED_ROUTE_GATE_UP=1; not yet timed on a GPU): the step between the router
(swap_gemm_triton.swap_gemm_topk) and fused_moe_small_triton's gate/up kernel, whose programs it
runs in one launch.

    programs [0, routers):   the fused router's (swap_gemm_triton._swap_program): logits, then the
                             last of them sums the splits, routes, and sets a flag (release, gpu scope)
    programs [routers, ...): gate/up's (fused_moe_small_triton._gate_up_program): their PDL wait,
                             then a poll of the flag (acquire), the routing read through the L2; the
                             last of them sets the flag back to zero

One launch and one kernel boundary a layer fewer than route_small + small_gate_up; the values are
theirs bit for bit. It runs only where all its programs fit the SMs at once, so the poll needs no
order of their start; the counters (kernels/counters.py) are touched only after the PDL wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, num_sms, pdl, stages_for
from pagedllm.kernels.attention import _dot_precision
from pagedllm.kernels.counters import counters
from pagedllm.kernels.fused_moe_small_triton import (
    _PAD_COLS,
    SMALL_MAX_PAIRS,
    _gate_up_program,
    down_preload,
    experts_per_program,
    small_down,
    stage_bytes,
    tiles_for,
)
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait
from pagedllm.kernels.swap_gemm_triton import FP16_MAX, SWAP_BLOCK_M, _operands, _split, _swap_program
from pagedllm.kernels.swap_gemm_triton import stage_bytes as swap_stage_bytes


@triton.jit
def _route_gate_up_kernel(
    x_ptr,  # [T, hidden]: the router's and the experts' input
    wr_ptr,  # [E_global, hidden] the router's gate, x's dtype
    logits_ptr,  # [T, E_global] float32: written
    ws_ptr,  # [R_SPLIT_K, T, E_global] float32 workspace of the router's splits
    count_ptr,  # int32 counters (kernels/counters.py): [0] the router's, [1] the routing's flag, [2] its readers
    topk_weights_ptr,  # [T, TOP_K] float32: written
    topk_ids_ptr,  # [T, TOP_K] int64: written
    w13_ptr, h_ptr, expert_map_ptr, expert_load_ptr, slot_mapping_ptr,  # as _small_gate_up_kernel's
    M, E, hidden, K_SPLIT, inter,
    stride_xm, stride_wr, stride_lm, stride_we, stride_wn, stride_hm,
    R_BLOCK_N: tl.constexpr, R_BLOCK_K: tl.constexpr, R_SPLIT_K: tl.constexpr, R_EVEN_K: tl.constexpr,
    OPERANDS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, BLOCK_M: tl.constexpr, FP16_MAX_: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_LOAD: tl.constexpr, HAS_SLOTS: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAD_COLS: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
):  # fmt: skip
    """The router's programs, then the gate/up ones (the module docstring)."""
    pid = tl.program_id(0)
    r_tiles = tl.cdiv(E, R_BLOCK_N)
    routers = r_tiles * R_SPLIT_K
    if pid < routers:
        pdl_release(PDL)
        _swap_program(pid % r_tiles, pid // r_tiles, r_tiles, x_ptr, wr_ptr, wr_ptr, wr_ptr, logits_ptr, ws_ptr,
                      count_ptr, topk_weights_ptr, topk_ids_ptr, M, E, hidden, K_SPLIT, stride_xm, stride_wr, 0,
                      stride_lm, False, 0, False, R_EVEN_K, R_SPLIT_K, True, False, TOP_K, RENORMALIZE, BLOCK_E,
                      BLOCK_TOPK, BLOCK_M, R_BLOCK_N, R_BLOCK_K, OPERANDS, FP16_MAX_, PDL, 0, count_ptr + 1, True)
    else:
        # the counters only after the previous kernel's end (it may count on them: kernels/counters.py);
        # every program is resident at once (route_experts_small launches no more than the SMs), so that
        # this wait always ends
        pdl_wait(PDL)
        ready = tl.atomic_add(count_ptr + 1, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = tl.atomic_add(count_ptr + 1, 0, sem="acquire", scope="gpu")
        pdl_release(PDL)  # the routing written: the down kernel's PRELOAD reads it before its own wait
        g = pid - routers
        n_tiles = tl.cdiv(inter, BLOCK_N)
        _gate_up_program(g // n_tiles, g % n_tiles, x_ptr, w13_ptr, h_ptr, topk_ids_ptr, expert_map_ptr,
                         expert_load_ptr, slot_mapping_ptr, inter, hidden, TOP_K, stride_xm, stride_we, stride_wn,
                         stride_hm, HAS_MAP, HAS_LOAD, HAS_SLOTS, EVEN_K, DOT_PRECISION, BLOCK_N, BLOCK_K, PAD_COLS,
                         True)  # fmt: skip
        # the last reader sets the flag and the readers' count back to zero (each read the flag first)
        seen = tl.atomic_add(count_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if seen == tl.num_programs(0) - routers - 1:
            tl.store(count_ptr + 1, 0)
            tl.store(count_ptr + 2, 0)


def route_experts_small(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    expert_map: torch.Tensor | None = None,
    expert_load: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    router_config=None,
    gate_up_tiles: tuple | None = None,
    down_tiles: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """small_m.route_small then fused_experts_small, the router and the gate/up products in one
    kernel (_route_gate_up_kernel): (out [T, H], logits [T, E] float32, topk_weights [T, K] float32,
    topk_ids [T, K] int64), the same values; None where the fused router does not apply
    (small_m.route_config; router_config given: taken as it is), the pairs pass SMALL_MAX_PAIRS, or the
    kernel's programs outnumber the SMs (all resident at once, the gate/up programs' wait on the router's
    flag needs no order of their start: 1 token of Qwen3-30B-A3B is 16 + 96 programs)."""
    from pagedllm.kernels.small_m import route_config

    num_tokens = x.shape[0]
    cfg = router_config or route_config(x, router_weight, top_k)
    if cfg is None or not 0 < num_tokens * top_k <= SMALL_MAX_PAIRS or w13.dtype != x.dtype:
        return None
    num_experts, hidden, inter = router_weight.shape[0], x.shape[1], w13.shape[1] // 2
    k_split, split_k = _split(hidden, cfg)
    block_n, block_k, num_warps, num_stages = gate_up_tiles or tiles_for(0, x.dtype, num_tokens, w13)
    routers = triton.cdiv(num_experts, cfg.block_n) * split_k
    programs = routers + num_tokens * top_k * triton.cdiv(inter, block_n)
    if x.is_cuda and programs > num_sms(x.device.index):
        return None
    x = x if x.stride(-1) == 1 else x.contiguous()
    f32 = dict(dtype=torch.float32, device=x.device)
    logits, weights = torch.empty((num_tokens, num_experts), **f32), torch.empty((num_tokens, top_k), **f32)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=x.device)
    ws = torch.empty((split_k, num_tokens, num_experts), **f32)
    h = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    down_tiles = down_tiles or tiles_for(1, x.dtype, num_tokens, w2)
    preload = down_preload() and experts_per_program(down_tiles, top_k) == 1
    # the two loops' buffers, both counted (whether the compiler shares them or not)
    stage = (stage_bytes(block_n, block_k, 2 * w13.element_size(), x.element_size())
             + swap_stage_bytes(cfg, x.element_size(), router_weight.element_size()))  # fmt: skip
    _route_gate_up_kernel[(programs,)](
        x, router_weight, logits, ws, counters(x.device, 3), weights, ids, w13, h,
        expert_map if expert_map is not None else ids, expert_load if expert_load is not None else ids,
        slot_mapping if slot_mapping is not None else ids, num_tokens, num_experts, hidden, k_split, inter,
        x.stride(0), router_weight.stride(0), logits.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        R_BLOCK_N=cfg.block_n, R_BLOCK_K=cfg.block_k, R_SPLIT_K=split_k, R_EVEN_K=k_split * split_k == hidden,
        OPERANDS=_operands(x, router_weight, None), TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_E=next_power_of_2(num_experts), BLOCK_TOPK=next_power_of_2(top_k), BLOCK_M=SWAP_BLOCK_M,
        FP16_MAX_=FP16_MAX, HAS_MAP=expert_map is not None, HAS_LOAD=expert_load is not None,
        HAS_SLOTS=slot_mapping is not None, EVEN_K=hidden % block_k == 0, DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_N=block_n, BLOCK_K=block_k, PAD_COLS=_PAD_COLS, num_warps=num_warps,
        num_stages=stages_for(x.device, num_stages, stage), **pdl(x),
    )  # fmt: skip
    out = small_down(h, w2, weights, ids, expert_map, down_tiles, preload=preload)
    return out, logits, weights, ids
