"""The MoE layer's small-batch path (a few tokens, e.g. batch-1 decode): routing and the experts
in two kernels, without the alignment, the top-k kernel and the separate sum over k. It must equal
fused_moe.fused_experts_torch after topk_softmax_torch (the tests compare them).

At 1-2 tokens the grouped path spends as long on its small kernels (top-k, the one-program
alignment, the sum over k: ~13 us a layer on the H200, each a fixed latency) as on reading the
8 chosen experts' weights. Here:

    router logits [T, E] ──▶ _moe_small_gate_up_kernel, grid (pair p = t*K + k, N tile of I)
                               each program: its token's top-k (`_topk_row`, recomputed by every
                               program: E floats), picks choice k, reads that expert's gate and
                               up rows, writes h[p] = silu(gate) * up, and (N tile 0) the pair's
                               local expert and routing weight (+ the expert-load counter)
                          ──▶ _moe_small_down_kernel, grid (token t, N tile of H)
                               each program loops over its token's k experts (one flat
                               pipelined loop over k x K tiles) and writes the weighted sum

Two ways to multiply (`dot`): tensor cores with the operands swapped (the weight tile is the
wide MMA operand, the one activation row the narrow one padded to 16: in the down kernel column
c of that operand holds expert c's row of h, so each expert's product stays apart and is rounded
and weighted as the reference does), or CUDA-core FMAs into a [BLOCK_N, BLOCK_K] float32 partial
reduced once at the end (the down kernel folds the routing weight into h in float32).

Every pair reads its expert's weights, so two tokens that share an expert read it twice: the
path is for T * K up to a few tens of pairs (`fused_moe.small_path_options`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2
from pagedllm.kernels.attention import _dot_precision
from pagedllm.kernels.fused_moe_triton import _topk_row

# the swapped product's narrow operand: one column per chosen expert in the down kernel
SMALL_BLOCK_P = 16
MAX_TOP_K = SMALL_BLOCK_P

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of each kernel; not yet swept on the H200
DEFAULT_CONFIG = {"gate_up": (32, 128, 4, 4), "down": (16, 256, 4, 4)}


@triton.jit
def _moe_small_gate_up_kernel(
    x_ptr,  # [T, H]
    logits_ptr,  # [T, E_global] float32
    w13_ptr,  # [E, 2I, H]
    h_ptr,  # [P, I] silu(gate) * up of each pair
    pair_w_ptr,  # [P] float32 routing weight
    pair_e_ptr,  # [P] int32 local expert, -1 where another rank holds it
    expert_map_ptr,  # [E_global] local id or -1 (read if HAS_MAP)
    expert_load_ptr,  # [E_global] int64 (added to if HAS_LOAD)
    slot_mapping_ptr,  # [T]: tokens with slot -1 (padding) are not counted in expert_load
    N,  # I
    K_dim,  # H
    num_experts,  # E_global
    stride_xm, stride_l, stride_we, stride_wn, stride_hm,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_MAP: tl.constexpr, HAS_LOAD: tl.constexpr,
    DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    tok = (pair // TOP_K).to(tl.int64)
    choice = pair % TOP_K
    w_all, ids_all = _topk_row(logits_ptr, tok, stride_l, num_experts, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_TOPK)
    pick = tl.arange(0, BLOCK_TOPK) == choice
    g = tl.sum(tl.where(pick, ids_all, 0), axis=0)  # global expert
    weight = tl.sum(tl.where(pick, w_all, 0.0), axis=0)
    if HAS_MAP:
        e = tl.load(expert_map_ptr + g).to(tl.int32)
    else:
        e = g.to(tl.int32)
    if pid_n == 0:
        tl.store(pair_w_ptr + pair, weight)
        tl.store(pair_e_ptr + pair, e)
        if HAS_LOAD:
            if tl.load(slot_mapping_ptr + tok) >= 0:
                tl.atomic_add(expert_load_ptr + g, g * 0 + 1)  # int64, as the counters
    if e < 0:
        return  # another rank's expert
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w13_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_row = x_ptr + tok * stride_xm
    if DOT:
        cols = tl.arange(0, BLOCK_P)
        acc_g = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K_dim, BLOCK_K):
        mask_k = (k0 + offs_k) < K_dim
        wg = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        wu = tl.load(w_ptrs + N * stride_wn, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if DOT:
            # x.T as the narrow operand: column 0 is the row, the others zero
            xt = tl.load(x_row + (k0 + offs_k)[:, None] + cols[None, :] * 0,
                         mask=mask_k[:, None] & (cols[None, :] == 0), other=0.0)
            acc_g += tl.dot(wg, xt, input_precision=DOT_PRECISION)
            acc_u += tl.dot(wu, xt, input_precision=DOT_PRECISION)
        else:
            xv = tl.load(x_row + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            acc_g += wg.to(tl.float32) * xv[None, :]
            acc_u += wu.to(tl.float32) * xv[None, :]
        w_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    dtype = h_ptr.dtype.element_ty
    # rounded like the reference: gate and up in the model dtype, silu rounded, then the product
    gate = gate.to(dtype).to(tl.float32)
    s = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    out = s * up.to(dtype).to(tl.float32)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, out.to(dtype), mask=mask_n)


@triton.jit
def _moe_small_down_kernel(
    h_ptr,  # [P, I]
    w2_ptr,  # [E, H, I]
    out_ptr,  # [T, H]
    pair_w_ptr,  # [P] float32
    pair_e_ptr,  # [P] int32 local expert or -1
    N,  # H
    K_dim,  # I
    stride_hm, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w2_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    first_pair = tok * TOP_K
    num_kb = tl.cdiv(K_dim, BLOCK_K)
    if DOT:
        cols = tl.arange(0, BLOCK_P)
        acc = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)  # column c: expert choice c
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # one flat loop over (choice, K tile), so that loads stay in flight across experts
    for it in range(0, TOP_K * num_kb):
        c = it // num_kb
        k0 = (it - c * num_kb) * BLOCK_K
        e = tl.load(pair_e_ptr + first_pair + c)
        # K mask, empty where another rank holds the expert (a vector: the interpreter refuses
        # a scalar broadcast into a mask)
        mask_k = ((k0 + offs_k) < K_dim) & (offs_k * 0 + e >= 0)
        w = tl.load(w_rows + tl.maximum(e, 0).to(tl.int64) * stride_we + k0,
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if DOT:
            ht = tl.load(h_ptr + (first_pair + cols[None, :]) * stride_hm + (k0 + offs_k)[:, None],
                         mask=mask_k[:, None] & (cols == c)[None, :], other=0.0)
            acc += tl.dot(w, ht, input_precision=DOT_PRECISION)
        else:
            hv = tl.load(h_ptr + (first_pair + c) * stride_hm + k0 + offs_k, mask=mask_k, other=0.0)
            rw = tl.load(pair_w_ptr + first_pair + c)
            acc += w.to(tl.float32) * (hv.to(tl.float32) * rw)[None, :]
    dtype = out_ptr.dtype.element_ty
    if DOT:
        # as the reference: each expert's output rounded, times its weight, rounded, summed
        rw = tl.load(pair_w_ptr + first_pair + cols, mask=cols < TOP_K, other=0.0)
        pe = tl.load(pair_e_ptr + first_pair + cols, mask=cols < TOP_K, other=-1)
        rw = tl.where(pe >= 0, rw, 0.0)
        y = (acc.to(dtype).to(tl.float32) * rw[None, :]).to(dtype).to(tl.float32)
        total = tl.sum(y, axis=1)
    else:
        total = tl.sum(acc, axis=1)
    tl.store(out_ptr + tok * stride_om + offs_n, total.to(dtype), mask=mask_n)


def fused_moe_small_triton(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           top_k: int, renormalize: bool, expert_map: torch.Tensor | None = None,
                           expert_load: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                           dot: bool = True, config: dict | None = None) -> torch.Tensor:
    """Routing (softmax, top-k, optional renormalization) and the experts' weighted sum in two
    kernels. x: [T, H]; router_logits: [T, E_global] float32; w13: [E, 2I, H]; w2: [E, H, I];
    expert_map / expert_load / slot_mapping: as fused_experts. -> [T, H] (this rank's part)."""
    if top_k > MAX_TOP_K:
        raise ValueError(f"top_k={top_k}: the small-batch MoE path serves at most {MAX_TOP_K} experts per token")
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    pair_w = torch.empty(num_pairs, dtype=torch.float32, device=x.device)
    pair_e = torch.empty(num_pairs, dtype=torch.int32, device=x.device)
    if expert_load is not None and slot_mapping is None:
        slot_mapping = torch.zeros(num_tokens, dtype=torch.int64, device=x.device)  # every token counts
    precision = _dot_precision(x.dtype)
    bn, bk, nw, ns = cfg["gate_up"]
    _moe_small_gate_up_kernel[(num_pairs, triton.cdiv(inter, bn))](
        x, logits, w13, h, pair_w, pair_e,
        expert_map if expert_map is not None else pair_e, expert_load if expert_load is not None else pair_e,
        slot_mapping if slot_mapping is not None else pair_e,
        inter, hidden, logits.shape[1], x.stride(0), logits.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, HAS_MAP=expert_map is not None, HAS_LOAD=expert_load is not None,
        DOT=dot, DOT_PRECISION=precision, BLOCK_E=next_power_of_2(logits.shape[1]),
        BLOCK_TOPK=next_power_of_2(top_k), BLOCK_P=SMALL_BLOCK_P, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=nw, num_stages=ns,
    )  # fmt: skip
    bn, bk, nw, ns = cfg["down"]
    _moe_small_down_kernel[(num_tokens, triton.cdiv(hidden, bn))](
        h, w2, out, pair_w, pair_e, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, DOT=dot, DOT_PRECISION=precision, BLOCK_P=SMALL_BLOCK_P, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=nw, num_stages=ns,
    )  # fmt: skip
    return out
