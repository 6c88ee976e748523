"""Triton kernels of the MoE layer; each must equal its torch reference in fused_moe.py.

- `_topk_softmax_kernel`: one program per token: softmax over the experts in float32, top-k by
  repeated max (the lowest expert id wins a tie), optional renormalization.
- `_moe_align_kernel`: one program: counts the pairs per expert (atomics: a pair's rank inside
  its expert is the counter's old value, so the order inside an expert's run varies between
  runs, which no output depends on: every row of a tile is computed alone), pads each run to
  `block_m`, scatters the pair ids, labels each block with its expert. It also adds the routed
  pairs into the per-expert load counters. No host sync, so CUDA graphs capture it.
- `_moe_gemm_kernel`: the grouped GEMM. Program (m, n) takes block m of the sorted pairs (one
  expert), gathers their rows of A and multiplies them by that expert's weight tile n. With
  GATED it reads the gate and the up tile and writes silu(gate) * up (the first projection and
  the activation in one pass); with MUL_WEIGHT it scales each row by its routing weight (the
  second projection). Blocks past `num_tokens_post_padded` return at once, so at batch 1 only
  the k chosen experts' weights are read.

`fused_experts_triton` takes these for more than SMALL_MAX_PAIRS pairs, the kernels of
fused_moe_small_triton.py below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2
from pagedllm.kernels.attention import _dot_precision
from pagedllm.kernels.fused_moe import max_padded_pairs, moe_align_block_size_torch
from pagedllm.kernels.fused_moe_small_triton import SMALL_MAX_PAIRS, fused_experts_small

# above this many (token, expert) pairs the one-program alignment is slower than torch's sort
_ALIGN_TRITON_MAX_PAIRS = 4096


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int64
    stride_l,
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.where(valid, tl.exp(x), 0.0)
    p = tl.where(valid, e / tl.sum(e, axis=0), -1.0)
    koffs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        m = tl.max(p, axis=0)
        i = tl.min(tl.where(p == m, offs, BLOCK_E), axis=0)
        w = tl.where(koffs == k, m, w)
        ids = tl.where(koffs == k, i.to(tl.int64), ids)
        p = tl.where(offs == i, -2.0, p)
    if RENORMALIZE:
        w = w / tl.sum(tl.where(koffs < TOP_K, w, 0.0), axis=0)
    tl.store(weights_ptr + row * TOP_K + koffs, w, mask=koffs < TOP_K)
    tl.store(ids_ptr + row * TOP_K + koffs, ids, mask=koffs < TOP_K)


def topk_softmax_triton(router_logits: torch.Tensor, top_k: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # router_logits: [T, E] -> (weights [T, K] float32, ids [T, K] int64)
    t, e = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](router_logits, weights, ids, router_logits.stride(0), e, TOP_K=top_k,
                                   RENORMALIZE=renormalize, BLOCK_E=next_power_of_2(e),
                                   BLOCK_K=next_power_of_2(top_k), num_warps=1)
    return weights, ids


@triton.jit
def _pairs_local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP: tl.constexpr):
    """(global id, local id or -1, in range & local) of the pairs at offs."""
    m = offs < num_pairs
    g = tl.load(topk_ids_ptr + offs, mask=m, other=0)
    if HAS_MAP:
        e = tl.load(expert_map_ptr + g, mask=m, other=-1)
    else:
        e = g
    return g, e, m & (e >= 0)


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [P] global expert ids
    expert_map_ptr,  # [E_global] local id or -1 (read if HAS_MAP)
    expert_load_ptr,  # [E_global] int64 counters (written if HAS_LOAD)
    slot_mapping_ptr,  # [T] int64: padding tokens (slot -1) are not counted in expert_load
    scratch_ptr,  # [2 * E + P] int32: counts | starts | rank of each pair
    sorted_ids_ptr,  # [L] int32
    expert_ids_ptr,  # [L / BLOCK_M] int32
    num_post_ptr,  # [1] int32
    num_pairs,
    num_experts,
    length,
    top_k,
    HAS_MAP: tl.constexpr,
    HAS_LOAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    counts_ptr = scratch_ptr
    starts_ptr = scratch_ptr + num_experts
    rank_ptr = scratch_ptr + 2 * num_experts
    offs_e = tl.arange(0, BLOCK_E)
    valid_e = offs_e < num_experts
    tl.store(counts_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=valid_e)
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        g, e, ok = _pairs_local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP)
        if HAS_LOAD:
            m = offs < num_pairs
            counted = m & (tl.load(slot_mapping_ptr + offs // top_k, mask=m, other=-1) >= 0)
            tl.atomic_add(expert_load_ptr + g, tl.full([BLOCK], 1, tl.int64), mask=counted)
        r = tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=ok)
        tl.store(rank_ptr + offs, r, mask=ok)
    tl.debug_barrier()
    c = tl.load(counts_ptr + offs_e, mask=valid_e, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + offs_e, ends - padded, mask=valid_e)
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_ids_ptr + offs, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=offs < length)
    tl.debug_barrier()
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        g, e, ok = _pairs_local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, HAS_MAP)
        dest = tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(rank_ptr + offs, mask=ok, other=0)
        tl.store(sorted_ids_ptr + dest, offs.to(tl.int32), mask=ok)
    num_blocks = length // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK):
        blocks = b0 + tl.arange(0, BLOCK)
        pos = blocks * BLOCK_M
        below = (ends[None, :] <= pos[:, None]) & valid_e[None, :]  # [BLOCK, BLOCK_E]
        eid = tl.minimum(tl.sum(below.to(tl.int32), axis=1), num_experts - 1)
        tl.store(expert_ids_ptr + blocks, eid, mask=blocks < num_blocks)


def moe_align_block_size_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                                expert_map: torch.Tensor | None = None,
                                expert_load: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None):
    """Same outputs as moe_align_block_size_torch (up to the order inside an expert's run)."""
    num_pairs = topk_ids.numel()
    length = max_padded_pairs(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(length, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(length // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    scratch = torch.empty(2 * num_experts + num_pairs, dtype=torch.int32, device=dev)
    flat = topk_ids.reshape(-1)
    if expert_load is not None and slot_mapping is None:
        slot_mapping = torch.zeros(topk_ids.shape[0], dtype=torch.int64, device=dev)  # every token counts
    _moe_align_kernel[(1,)](
        flat, expert_map if expert_map is not None else flat, expert_load if expert_load is not None else flat,
        slot_mapping if slot_mapping is not None else flat,
        scratch, sorted_ids, expert_ids, num_post, num_pairs, num_experts, length, topk_ids.shape[1],
        HAS_MAP=expert_map is not None, HAS_LOAD=expert_load is not None, BLOCK_M=block_m,
        BLOCK_E=next_power_of_2(num_experts), BLOCK=128, num_warps=4,
    )
    return sorted_ids, expert_ids, num_post


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [T, K_dim] (A_PER_PAIR: [P, K_dim])
    b_ptr,  # [E, N (x2 if GATED), K_dim]
    c_ptr,  # [P, N]
    topk_weights_ptr,  # [P] float32
    sorted_ids_ptr,  # [L]
    expert_ids_ptr,  # [L / BLOCK_M]
    num_post_ptr,  # [1]
    N,
    K_dim,
    num_pairs,
    top_k,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    A_PER_PAIR: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if A_PER_PAIR:
        a_row = pair.to(tl.int64)
    else:
        a_row = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K_dim, BLOCK_K):
        mask_k = (k0 + offs_k) < K_dim
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    dtype = c_ptr.dtype.element_ty
    if GATED:
        # rounded like the reference: gate and up in the model dtype, silu rounded, then the product
        g = acc.to(dtype).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = s * acc_up.to(dtype).to(tl.float32)
    else:
        out = acc
    if MUL_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)
        out = out.to(dtype).to(tl.float32) * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(dtype), mask=valid[:, None] & mask_n[None, :])


def _gemm_config(num_pairs: int, num_experts: int, n: int) -> dict:
    """Tiles by the mean rows per expert: decode-sized batches read each expert's weights
    with small M tiles (memory bound), prefill takes wide tiles (compute bound)."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32 if n <= 1024 else 64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def _grouped_gemm(a, b, c, topk_weights, sorted_ids, expert_ids, num_post, n, top_k, *, a_per_pair, gated,
                  mul_weight, cfg):
    num_pairs = c.shape[0]
    # every block of the aligned pairs that can hold a pair (see max_padded_pairs)
    grid = (sorted_ids.shape[0] // cfg["BLOCK_M"], triton.cdiv(n, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_post, n, a.shape[1], num_pairs, top_k,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        A_PER_PAIR=a_per_pair, GATED=gated, MUL_WEIGHT=mul_weight, DOT_PRECISION=_dot_precision(a.dtype), **cfg,
    )


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                         expert_load: torch.Tensor | None = None,
                         slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """The experts on CUDA: x [T, H], topk_*: [T, K] -> [T, H]. Up to SMALL_MAX_PAIRS (token,
    expert) pairs the small-batch kernels (fused_moe_small_triton.py: no alignment, no separate
    sum), the grouped GEMMs above that. The choice is by shape, so each captured graph keeps one."""
    if topk_ids.numel() <= SMALL_MAX_PAIRS:
        return fused_experts_small(x, w13, w2, topk_weights, topk_ids, expert_map, expert_load, slot_mapping)
    return fused_experts_grouped(x, w13, w2, topk_weights, topk_ids, expert_map, expert_load, slot_mapping)


def fused_experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                          expert_load: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                          config: dict | None = None) -> torch.Tensor:
    # x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_*: [T, K] -> [T, H]
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return x.new_zeros((0, hidden))
    cfg = config or _gemm_config(num_pairs, num_experts, inter)
    align = moe_align_block_size_triton if num_pairs <= _ALIGN_TRITON_MAX_PAIRS else moe_align_block_size_torch
    sorted_ids, expert_ids, num_post = align(topk_ids, num_experts, cfg["BLOCK_M"], expert_map, expert_load,
                                             slot_mapping)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32)
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    _grouped_gemm(x, w13, h, weights, sorted_ids, expert_ids, num_post, inter, top_k,
                  a_per_pair=False, gated=True, mul_weight=False, cfg=cfg)
    # pairs of other ranks are never written: zeros, so that the sum below leaves them out
    alloc = torch.zeros if expert_map is not None else torch.empty
    y = alloc((num_pairs, hidden), dtype=x.dtype, device=x.device)  # [P, H]
    cfg2 = config or _gemm_config(num_pairs, num_experts, hidden)
    if cfg2["BLOCK_M"] != cfg["BLOCK_M"]:
        cfg2 = dict(cfg2, BLOCK_M=cfg["BLOCK_M"])
    _grouped_gemm(h, w2, y, weights, sorted_ids, expert_ids, num_post, hidden, top_k,
                  a_per_pair=True, gated=False, mul_weight=True, cfg=cfg2)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
