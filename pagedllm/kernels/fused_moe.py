"""Mixture-of-experts compute: routing (softmax then top-k), the token-to-expert alignment, and
the experts' gated MLPs with the router-weighted combine. The torch functions here are the
references (and the CPU path); fused_moe_triton.py holds the Triton kernels that must equal
them, used for CUDA tensors.

Weights of the experts this rank holds, stacked:

    w13: [E_local, 2 * I, H]   rows [0, I) are the gate projection, [I, 2I) the up projection
    w2:  [E_local, H, I]       the down projection

A (token, k) pair is "pair" p = t * top_k + k. The alignment sorts the pairs by expert and
pads each expert's run to a multiple of `block_m`, so that every block of `block_m` sorted
rows belongs to one expert (one tile of a grouped GEMM reads one expert's weights):

    topk_ids = [[2, 0], [2, 1]]  (T=2, K=2), E=3, block_m=4, pairs p=0..3 -> experts 2 0 2 1
    sorted_ids = [1, P, P, P | 3, P, P, P | 0, 2, P, P]   (P = 4: padding, never read or written)
    expert_ids = [0, 1, 2]     num_tokens_post_padded = [12]

Under expert parallelism `expert_map[global id]` is the local id, or -1 where another rank holds
the expert; those pairs are left out (their rows of the output stay zero here and come from
the owning rank through the all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels._triton import use_triton


# ---- routing --------------------------------------------------------------------------------
def topk_softmax_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As transformers routes: softmax over all experts in float32, the top-k of the
    probabilities (torch.topk's order, ties included), optionally renormalized to sum to 1.
    router_logits: [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64)"""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(router_logits):
        from pagedllm.kernels.fused_moe_triton import topk_softmax_triton

        return topk_softmax_triton(router_logits, top_k, renormalize)
    return topk_softmax_torch(router_logits, top_k, renormalize)


# ---- alignment ------------------------------------------------------------------------------
def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the aligned length, known on the host without reading the routing:
    each expert's run of c pairs takes ceil(c / block_m) <= c / block_m + 1 blocks, and at most
    min(E, P) runs are not empty (at batch 1: 8 pairs, 128 experts, block 16 -> 9 blocks)."""
    blocks = min(-(-(num_pairs + num_experts * (block_m - 1)) // block_m),
                 -(-num_pairs // block_m) + min(num_experts, num_pairs))
    return blocks * block_m


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                               expert_map: torch.Tensor | None = None,
                               expert_load: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None):
    """topk_ids: [T, K] global expert ids; num_experts: experts of this rank (E_local).
    Returns sorted_ids [L] int32 (pair index, or T*K for padding), expert_ids [L / block_m]
    int32 (local expert of each block; blocks past the end repeat the last one and are not
    run), num_tokens_post_padded [1] int32, with L = max_padded_pairs(T*K, E_local, block_m).
    Adds the pairs routed to each global expert into expert_load [E_global] (if given),
    leaving out padding tokens (slot_mapping [T] -1). No host synchronisation: every size is known from the shapes."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1)  # [P]
    num_pairs = flat.numel()
    if expert_load is not None:
        count_expert_load(expert_load, topk_ids, slot_mapping)
    local = flat if expert_map is None else expert_map[flat]
    bucket = torch.where(local < 0, num_experts, local).long()  # [P]; E_local = not on this rank
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E]
    starts = ends - padded
    order = torch.argsort(bucket, stable=True)  # pairs by expert
    sorted_bucket = bucket[order]
    first = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position of each bucket
    rank = torch.arange(num_pairs, device=device) - first[sorted_bucket]
    length = max_padded_pairs(num_pairs, num_experts, block_m)
    # pairs of other ranks go to one spare slot at the end, dropped below
    dest = torch.where(sorted_bucket < num_experts,
                       torch.cat([starts, starts.new_full((1,), length)])[sorted_bucket] + rank,
                       torch.full_like(rank, length))
    sorted_ids = torch.full((length + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, length, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=max(num_experts - 1, 0))
    return sorted_ids[:length], expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


def count_expert_load(expert_load: torch.Tensor, topk_ids: torch.Tensor, slot_mapping: torch.Tensor | None) -> None:
    # expert_load: [E_global] += pairs routed to each expert by the tokens with a slot
    ones = torch.ones_like(topk_ids, dtype=expert_load.dtype)
    if slot_mapping is not None:
        ones = ones * (slot_mapping >= 0).to(expert_load.dtype).unsqueeze(1)
    expert_load.index_add_(0, topk_ids.reshape(-1), ones.reshape(-1))


# ---- experts --------------------------------------------------------------------------------
def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: a loop over the experts that have tokens. Rounds as transformers does
    in the model dtype: silu(gate) * up, down, times the routing weight, summed over k.
    x: [T, H], topk_weights/ids: [T, K] -> [T, H]"""
    num_tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    flat = topk_ids.reshape(-1)
    local = flat if expert_map is None else expert_map[flat]
    out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)  # [P, H]
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local.clamp(min=-1) + 1, minlength=w13.shape[0] + 1).tolist()
    start = counts[0]  # pairs of other ranks sort first (local id -1)
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        h = F.linear(x[pairs // top_k], w13[e])  # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e])  # [n, H]
        out[pairs] = (y * topk_weights.reshape(-1)[pairs, None]).to(x.dtype)
    return combine_in_expert_order(out.view(num_tokens, top_k, -1), topk_ids)


def combine_in_expert_order(y: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Sums each token's k outputs in increasing expert id, one add at a time, as
    transformers' loop over experts does (float addition is not associative, and greedy
    equality in float32 depends on the last bit). y: [T, K, H] -> [T, H]"""
    order = topk_ids.argsort(dim=1)  # [T, K]
    y = y.gather(1, order.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
    acc = y[:, 0].clone()
    for k in range(1, y.shape[1]):
        acc += y[:, k]
    return acc


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  expert_load: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' output for each token, weighted and summed over its top-k: [T, H]. The
    Triton grouped GEMMs on CUDA, the torch loop elsewhere. expert_load: see
    moe_align_block_size_torch."""
    if use_triton(x):
        from pagedllm.kernels.fused_moe_triton import fused_experts_triton

        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, expert_map, expert_load, slot_mapping)
    if expert_load is not None:
        count_expert_load(expert_load, topk_ids, slot_mapping)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, expert_map)
