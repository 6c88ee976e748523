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

Split-K: SPLIT_K programs per N tile each sum a range of K. Three ways to add their partials:

    workspace, reduce "kernel" (default): split i stores float32 [M, N] at ws[i];
                          `_splitk_reduce_kernel` sums the splits in a fixed order and applies
                          the epilogue (deterministic)
    workspace, reduce "last": the same stores, then each program counts itself done on its N
                          tile's counter (kernels/counters.py: a barrier, then an acq_rel atomic at
                          gpu scope); the program that counts SPLIT_K - 1 reads the tile's splits
                          back from the L2 (.cg) in the same fixed order, applies the epilogue,
                          writes out and sets the counter back to 0: the reduce kernel's result
                          bit for bit, without its launch (nor its ~0.7 us gap in a CUDA graph)
(Float32 atomics into the output were measured too, the MoE router 3.61 us against the reduce
kernel's 4.33, and removed: the order of their adds varies from run to run, and a near-tie of two
experts' logits could then route a token differently.)

`swap_gemm_topk` (the MoE router of few tokens, float32 logits): the workspace with one counter
for the whole grid; the last of all programs sums every tile's splits (the logits of all N
experts, which it also writes), then does each token's softmax and top-k as
fused_moe_triton's `_topk_softmax_kernel` does (ties: the lowest expert id), writing the routing
weights and ids: no top-k kernel either.

All are CUDA-graph capturable: no host synchronization, buffers from the caching allocator, the
counters zero again at the end of every call (or replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import next_power_of_2, pdl, pdl_weights, stages_for
from pagedllm.kernels.counters import counters
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait, prefetch_rows_l2

# the padded row count (the narrow MMA operand): the kernel serves at most this many rows
SWAP_BLOCK_M = 16
FP16_MAX = 65504.0
REDUCES = ("kernel", "last")
DOTS_MODES = ("chain", "accs", "accs2")  # the kpairs GEMM's K step: SwapConfig.dots


@dataclass(frozen=True, slots=True)
class SwapConfig:
    """One launch configuration of the swap-AB kernel."""

    block_n: int  # weight rows (output features) per program: the MMA's M side
    block_k: int  # K per loop iteration
    split_k: int = 1  # programs per N tile, each over a range of K
    num_warps: int = 4
    num_stages: int = 3
    reduce: str = "kernel"  # the workspace's sum: "kernel" (a reduce kernel) or "last" (the last split)
    block_m: int = SWAP_BLOCK_M  # activation rows per program: the MMA's N side (the 4-bit kernel's tiles of
    # 64 / 128 rows make it a GEMM for large batches; the 16-bit and FP8 kernels keep SWAP_BLOCK_M)
    pairs: bool = False  # (the 4-bit kernel) wna16_pairs_triton._swap_int4_pairs_kernel: its weight operand
    # built in the MMA's register layout, four dots a K step (BLOCK_K a multiple of 64)
    dots: str = "chain"  # (the kpairs GEMM) how a K step's four dots run: DOTS_MODES (wna16_kpairs_triton.py)
    stream_k: int = 0  # (the kpairs GEMM) > 0: stream-K over this many programs (split_k unused), one an SM

    def __post_init__(self) -> None:
        if self.reduce not in REDUCES:
            raise ValueError(f"SwapConfig.reduce must be one of {', '.join(REDUCES)}, got {self.reduce!r}")
        if self.dots not in DOTS_MODES:
            raise ValueError(f"SwapConfig.dots must be one of {', '.join(DOTS_MODES)}, got {self.dots!r}")


@triton.jit
def _epilogue(acc, s_ptr, b_ptr, rn, n_mask, b_mask, stride_sn,
              SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] (x.T's layout) times the row scales (FP8, GROUP_K 0) plus the bias
    where b_mask."""
    if SCALED and GROUP_K == 0:
        acc = acc * tl.load(s_ptr + rn.to(tl.int64) * stride_sn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=b_mask, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _sum_splits(ws_ptr, rm, rn, mask, M, N, SPLIT_K: tl.constexpr):
    """[BLOCK_N, BLOCK_M]: the workspace's splits of these rows and columns, added in split order
    from zero (as `_splitk_reduce_kernel` adds them), read from the L2 (.cg: the other programs'
    stores are there, never in this SM's L1)."""
    acc = tl.zeros([rn.shape[0], rm.shape[0]], dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (i * M + rm[None, :]) * N + rn[:, None], mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _route(logits, e_mask, rm, m_mask, weights_ptr, ids_ptr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
           BLOCK_TOPK: tl.constexpr):  # fmt: skip
    """`_topk_softmax_kernel` (fused_moe_triton.py) on the columns of logits [BLOCK_E, BLOCK_M]
    (column m: token m's logits): softmax over the experts in float32, top-k by repeated max
    with the lowest expert id winning a tie, optionally renormalized; weights [M, TOP_K]
    float32, ids [M, TOP_K] int64."""
    offs = tl.arange(0, logits.shape[0])[:, None]  # [BLOCK_E, 1]
    x = tl.where(e_mask[:, None], logits, float("-inf"))
    x = x - tl.max(x, axis=0)[None, :]
    e = tl.where(e_mask[:, None], tl.exp(x), 0.0)
    p = tl.where(e_mask[:, None], e / tl.sum(e, axis=0)[None, :], -1.0)
    # (gathering the picks as [BLOCK_TOPK, BLOCK_M], the logits' own layout, took the barriers after the
    # count from 37 to 9 on sm_90 but Qwen3-30B-A3B batch 1 from 3.248 to 3.290 ms/token on an H100:
    # RESULTS.md, thirty-fourth session; this layout stays)
    koffs = tl.arange(0, BLOCK_TOPK)[None, :]  # [1, BLOCK_TOPK]
    w = tl.zeros([rm.shape[0], BLOCK_TOPK], dtype=tl.float32)
    ids = tl.zeros([rm.shape[0], BLOCK_TOPK], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        m = tl.max(p, axis=0)  # [BLOCK_M]
        i = tl.min(tl.where(p == m[None, :], offs, logits.shape[0]), axis=0)
        w = tl.where(koffs == k, m[:, None], w)
        ids = tl.where(koffs == k, i.to(tl.int64)[:, None], ids)
        p = tl.where(offs == i[None, :], -2.0, p)
    if RENORMALIZE:
        w = w / tl.sum(tl.where(koffs < TOP_K, w, 0.0), axis=1)[:, None]
    out_mask = m_mask[:, None] & (koffs < TOP_K)
    tl.store(weights_ptr + rm[:, None] * TOP_K + koffs, w, mask=out_mask)
    tl.store(ids_ptr + rm[:, None] * TOP_K + koffs, ids, mask=out_mask)


@triton.jit
def _swap_kernel(
    x_ptr,  # [M, K] activations, M <= BLOCK_M
    w_ptr,  # [N, K] float8 e4m3 (SCALED) or 16-bit
    s_ptr,  # [N, G] float32 scales (read when SCALED)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N]: the output; written unless the reduce kernel does
    ws_ptr,  # [SPLIT_K, M, N] float32 workspace (WORKSPACE)
    count_ptr,  # int32 counters, zero between calls (LAST: one per N tile; TOP_K > 0: one)
    topk_weights_ptr,  # [M, TOP_K] float32 (TOP_K > 0)
    topk_ids_ptr,  # [M, TOP_K] int64 (TOP_K > 0)
    M, N, K, K_SPLIT,  # K_SPLIT: the K range of one split, a multiple of BLOCK_K
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WORKSPACE: tl.constexpr,  # the splits' partials go to ws (reduced by LAST, TOP_K or the reduce kernel)
    LAST: tl.constexpr,  # the last split of an N tile reduces it (reduce "last")
    TOP_K: tl.constexpr,  # > 0: the last program of all reduces every tile and routes (swap_gemm_topk)
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,  # (TOP_K > 0)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    OPERANDS: tl.constexpr,  # "fp16", "weight" or "fp32" (the module docstring)
    FP16_MAX_: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
    PREFETCH_K: tl.constexpr = 0,  # > 0 (with PDL): the first PREFETCH_K columns of the weight rows
    # are asked of L2 before the wait
):  # fmt: skip
    pdl_release(PDL)
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
    if PREFETCH_K > 0:
        prefetch_rows_l2(w_ptr + rn64 * stride_wn, n_mask, k_start, tl.minimum(k_start + K_SPLIT, K), PREFETCH_K)
    pdl_wait(PDL)
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):  # (the last split may end early)
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
    if not WORKSPACE:  # one split
        acc = _epilogue(acc, s_ptr, b_ptr, rn, n_mask, n_mask, stride_sn, SCALED, GROUP_K, HAS_BIAS)
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ws_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None], acc, mask=out_mask)
        if LAST or TOP_K > 0:
            # every thread's stores before the barrier, the barrier before the count, whose
            # release publishes them at gpu scope (and whose acquire, in the last program,
            # orders its loads of the workspace after it)
            tl.debug_barrier()
            if TOP_K > 0:
                counter = count_ptr
                programs = tl.num_programs(0) * SPLIT_K
            else:
                counter = count_ptr + pid_n
                programs = SPLIT_K
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == programs - 1:
                if TOP_K > 0:
                    re = tl.arange(0, BLOCK_E)
                    e_mask = re < N
                    logits = _sum_splits(ws_ptr, rm, re, e_mask[:, None] & m_mask[None, :], M, N, SPLIT_K)
                    logits = _epilogue(logits, s_ptr, b_ptr, re, e_mask, e_mask, stride_sn, SCALED, GROUP_K,
                                       HAS_BIAS)  # fmt: skip
                    tl.store(out_ptr + rm[None, :] * stride_om + re[:, None], logits.to(out_ptr.dtype.element_ty),
                             mask=e_mask[:, None] & m_mask[None, :])  # fmt: skip
                    _route(logits, e_mask, rm, m_mask, topk_weights_ptr, topk_ids_ptr, TOP_K, RENORMALIZE,
                           BLOCK_TOPK)  # fmt: skip
                else:
                    acc = _sum_splits(ws_ptr, rm, rn, out_mask, M, N, SPLIT_K)
                    acc = _epilogue(acc, s_ptr, b_ptr, rn, n_mask, n_mask, stride_sn, SCALED, GROUP_K, HAS_BIAS)
                    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                             mask=out_mask)  # fmt: skip
                tl.store(counter, 0)  # zero again for the next call (or graph replay)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,  # [SPLIT_K, M, N] float32 partial sums
    s_ptr, b_ptr, out_ptr,  # scales [N, G] (read when SCALED), bias [N], out [M, N]
    M, N, stride_sn, stride_om,
    SPLIT_K: tl.constexpr, SCALED: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # kernels/pdl_triton.py
):  # fmt: skip
    pdl_release(PDL)
    pdl_wait(PDL)
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


def _operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> str:
    if weight_scale is not None:
        return "fp32" if x.dtype == torch.float32 else "fp16"
    assert weight.dtype in (torch.bfloat16, torch.float16), "an unscaled weight must be 16-bit"
    return "weight"


def _split(k: int, cfg: SwapConfig) -> tuple[int, int]:
    """(K range of one split, number of splits): whole BLOCK_K steps, no empty split."""
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_split, triton.cdiv(k, k_split)


def stage_bytes(cfg: SwapConfig, x_size: int, w_size: int) -> int:
    """The shared memory one pipeline stage of the swap-AB kernel holds: its weight tile and x.T's."""
    return cfg.block_k * (cfg.block_n * w_size + SWAP_BLOCK_M * x_size)


def _stages(cfg: SwapConfig, x: torch.Tensor, weight: torch.Tensor) -> int:
    """cfg.num_stages, fewer where its stages would not fit the device's shared memory (the tables
    are the H100's / H200's: an L4's 99 KB takes 3 of the 64 x 256 tiles' 4)."""
    return stages_for(x.device, cfg.num_stages, stage_bytes(cfg, x.element_size(), weight.element_size()))


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
    k_split, split_k = _split(k, cfg)
    scaled = weight_scale is not None
    s = weight_scale if scaled else weight  # an unused pointer when not SCALED
    b = bias if bias is not None else s  # likewise when there is no bias
    workspace = split_k > 1
    last = workspace and cfg.reduce == "last"
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if workspace else out
    num_n = triton.cdiv(n, cfg.block_n)
    count = counters(x.device, num_n) if last else out
    _swap_kernel[(num_n, split_k)](
        x, weight, s, b, out, ws, count, out, out, m, n, k, k_split,
        x.stride(0), weight.stride(0), s.stride(0), out.stride(0),
        SCALED=scaled, GROUP_K=group_k, HAS_BIAS=bias is not None, EVEN_K=k_split * split_k == k,
        SPLIT_K=split_k, WORKSPACE=workspace, LAST=last, TOP_K=0, RENORMALIZE=False, BLOCK_E=1,
        BLOCK_TOPK=1, BLOCK_M=SWAP_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        OPERANDS=_operands(x, weight, weight_scale), FP16_MAX_=FP16_MAX, num_warps=cfg.num_warps,
        num_stages=_stages(cfg, x, weight), **pdl_weights(x, weight, cfg.block_k),
    )  # fmt: skip
    if workspace and not last:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(n, block), m)](
            ws, s, b, out, m, n, s.stride(0), out.stride(0),
            SPLIT_K=split_k, SCALED=scaled, GROUP_K=group_k, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
            **pdl(x),
        )  # fmt: skip


# the fused router's last program holds all N logits of the 16 padded rows: [BLOCK_E, 16] float32
TOPK_MAX_EXPERTS = 256


def swap_gemm_topk(
    x: torch.Tensor,  # [M, K] 16-bit, M <= SWAP_BLOCK_M, unit stride along K
    weight: torch.Tensor,  # [E, K] the router's gate, x's dtype, unit stride along K
    logits: torch.Tensor,  # [M, E] float32: written
    cfg: SwapConfig,  # its split_k, tiles and warps; reduce is not read
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_weights [M, top_k] float32, topk_ids [M, top_k] int64)
    """The MoE router's product and its routing in one launch: logits = x @ weight.T as swap_gemm
    writes them (float32, the splits added in order), then topk_softmax of each row (see the
    module docstring). E <= TOPK_MAX_EXPERTS."""
    m, k = x.shape
    n = weight.shape[0]
    assert 0 < m <= SWAP_BLOCK_M and n <= TOPK_MAX_EXPERTS and 0 < top_k <= n and logits.dtype == torch.float32
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1 and logits.stride(1) == 1
    k_split, split_k = _split(k, cfg)
    weights = torch.empty((m, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((m, top_k), dtype=torch.int64, device=x.device)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _swap_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x, weight, weight, weight, logits, ws, counters(x.device, 1), weights, ids, m, n, k, k_split,
        x.stride(0), weight.stride(0), 0, logits.stride(0),
        SCALED=False, GROUP_K=0, HAS_BIAS=False, EVEN_K=k_split * split_k == k, SPLIT_K=split_k,
        WORKSPACE=True, LAST=False, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=next_power_of_2(n),
        BLOCK_TOPK=next_power_of_2(top_k), BLOCK_M=SWAP_BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        OPERANDS=_operands(x, weight, None), FP16_MAX_=FP16_MAX, num_warps=cfg.num_warps,
        num_stages=_stages(cfg, x, weight), **pdl_weights(x, weight, cfg.block_k),
    )  # fmt: skip
    return weights, ids
