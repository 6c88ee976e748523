"""The MoE kernels (pagedllm/kernels/fused_moe_triton.py) against their torch references on
random inputs: uneven expert loads, experts with no tokens, top-k ties, expert parallelism's
map of non-local experts (CUDA; skipped without it).

The `check_*` functions take a device, so tests/unit/test_fused_moe_interpret.py runs them on
the CPU under Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (test_small_m_gpu's env_switch)
HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

# bf16: outputs are sums of k rounded products, one ulp of a large partial is ~1.5e-2
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (3e-2, 2e-2)}


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, skew: str) -> torch.Tensor:
    """Top-k expert ids per token, [T, K], distinct within a row but for "repeat". skew:
    "uniform"; "hot" (most tokens pick from 3 experts, so others stay empty); "one-empty"
    (expert 1 never chosen); "repeat" (each row's second id repeats its first)."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if skew == "hot":
        scores[:, :3] += 2.0 * (torch.rand(num_tokens, 1, generator=gen) < 0.8)
    if skew == "one-empty":
        scores[:, 1] = -1.0
    ids = scores.topk(top_k, dim=1).indices
    if skew == "repeat":
        ids[:, 1] = ids[:, 0]
    return ids


def dense_reference(x, w13, w2, topk_weights, topk_ids, expert_map=None):
    """The experts token by token, with no grouping at all (checks the grouped reference)."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            h = F.linear(x[t].double(), w13[e].double())
            y = F.linear(F.silu(h[:inter]) * h[inter:], w2[e].double())
            out[t] += topk_weights[t, k].double() * y
    return out


def _inputs(device, dtype, num_tokens, hidden, inter, num_experts, top_k, seed, skew, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
    ids = _routing(num_tokens, num_experts, top_k, g, skew).to(device)
    weights = torch.rand(num_tokens, top_k, generator=g)
    if ties:
        weights[:] = 1.0 / top_k  # every chosen expert weighs the same
    return x, w13, w2, weights.to(device), ids


def _second_rank_experts(w13, w2, ep_ranks: int):
    """(w13, w2, expert_map) of the rank holding the second block of experts under expert
    parallelism over ep_ranks ranks; the inputs and no map at ep_ranks 1."""
    if ep_ranks == 1:
        return w13, w2, None
    num_experts = w13.shape[0]
    local = num_experts // ep_ranks
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=w13.device)
    expert_map[local : 2 * local] = torch.arange(local, dtype=torch.int32, device=w13.device)
    return w13[local : 2 * local].contiguous(), w2[local : 2 * local].contiguous(), expert_map


def check_fused_experts(device, dtype, num_tokens, hidden, inter, num_experts, top_k, skew="uniform",
                        ties=False, ep_ranks=1, seed=0, path="auto", tiles=None, calls=1, preload=True,
                        tile_env=(None, None)):  # fmt: skip
    """path: "auto" (fused_experts_triton's choice), "grouped" or "small"; tiles: the small
    path's (gate/up, down) tiles, if None its own choice (tiles_for); calls: checked that many times in a
    row on new inputs (seeds seed, seed + 1, ...: the small down kernel's counters must be back at zero);
    preload: PAGEDLLM_MOE_PRELOAD, on by default (the down kernel's first tile before its wait, added last);
    tile_env: PAGEDLLM_MOE_GATE_UP_CONFIG and PAGEDLLM_MOE_DOWN_CONFIG (None: as they are)."""
    from test_small_m_gpu import env_switch

    from pagedllm.kernels import fused_moe_small_triton as small

    with (env_switch("PAGEDLLM_MOE_PRELOAD", "1" if preload else "0", small.down_preload),
          env_switch("PAGEDLLM_MOE_GATE_UP_CONFIG", tile_env[0], small.tile_overrides),
          env_switch("PAGEDLLM_MOE_DOWN_CONFIG", tile_env[1], small.tile_overrides)):  # fmt: skip
        for s in range(seed, seed + calls):
            _check_fused_experts_once(
                device, dtype, num_tokens, hidden, inter, num_experts, top_k, skew, ties, ep_ranks, s, path, tiles
            )


def _check_fused_experts_once(
    device, dtype, num_tokens, hidden, inter, num_experts, top_k, skew, ties, ep_ranks, seed, path, tiles
):
    from pagedllm.kernels import fused_moe_small_triton as small
    from pagedllm.kernels.fused_moe import fused_experts_torch
    from pagedllm.kernels.fused_moe_triton import fused_experts_grouped, fused_experts_triton

    x, w13, w2, weights, ids = _inputs(device, dtype, num_tokens, hidden, inter, num_experts, top_k, seed, skew, ties)
    w13, w2, expert_map = _second_rank_experts(w13, w2, ep_ranks)
    ref = fused_experts_torch(x, w13, w2, weights, ids, expert_map)
    if dtype == torch.float32 and num_tokens <= 64:
        dense = dense_reference(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(),
                                None if expert_map is None else expert_map.cpu())
        torch.testing.assert_close(ref.double().cpu(), dense, atol=1e-4, rtol=1e-4)
    load = torch.zeros(num_experts, dtype=torch.int64, device=device)
    slots = torch.arange(num_tokens, device=device)
    slots[num_tokens // 2 :: 3] = -1  # padding rows: computed, not counted in the load
    if path == "small":
        gate_up, down = (tuple(t) for t in tiles) if tiles else (None, None)
        got = small.fused_experts_small(x, w13, w2, weights, ids, expert_map, load, slots, gate_up, down)
    else:
        run = fused_experts_grouped if path == "grouped" else fused_experts_triton
        got = run(x, w13, w2, weights, ids, expert_map, load, slots)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    expected_load = torch.bincount(ids.cpu()[slots.cpu() >= 0].reshape(-1), minlength=num_experts)
    assert torch.equal(load.cpu(), expected_load), "expert load counters"


def check_align(device, ids_dtype, num_tokens, num_experts, top_k, block_m, skew="hot", ep_ranks=1, seed=0):
    """Both alignments: each pair once, in a block of its own expert; padding elsewhere.
    ids_dtype: of the top-k ids (torch.topk gives int64; int32 ids work too)."""
    from pagedllm.kernels.fused_moe import moe_align_block_size_torch
    from pagedllm.kernels.fused_moe_triton import moe_align_block_size_triton

    g = torch.Generator().manual_seed(seed)
    ids = _routing(num_tokens, num_experts, top_k, g, skew).to(device, ids_dtype)
    local_n = num_experts // ep_ranks
    expert_map = None
    if ep_ranks > 1:
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
        expert_map[:local_n] = torch.arange(local_n, dtype=torch.int32, device=device)
    flat = ids.reshape(-1).cpu().long()
    local = flat if expert_map is None else expert_map.cpu()[flat].long()
    num_pairs = flat.numel()
    for align in (moe_align_block_size_torch, moe_align_block_size_triton):
        sorted_ids, expert_ids, num_post = (t.cpu() for t in align(ids, local_n, block_m, expert_map))
        counts = torch.bincount(local[local >= 0], minlength=local_n)
        assert int(num_post) == int(((counts + block_m - 1) // block_m * block_m).sum()), align.__name__
        n = int(num_post)
        assert (sorted_ids[n:] == num_pairs).all()
        real = sorted_ids[:n][sorted_ids[:n] < num_pairs].long()
        assert sorted(real.tolist()) == sorted(torch.nonzero(local >= 0).flatten().tolist()), align.__name__
        for b in range(n // block_m):
            rows = sorted_ids[b * block_m : (b + 1) * block_m]
            rows = rows[rows < num_pairs].long()
            assert (local[rows] == expert_ids[b]).all(), f"{align.__name__}: block {b}"


def check_topk_softmax(device, dtype, num_tokens, num_experts, top_k, renormalize, ties=False, seed=0):
    from pagedllm.kernels.fused_moe import topk_softmax_torch
    from pagedllm.kernels.fused_moe_triton import topk_softmax_triton

    g = torch.Generator().manual_seed(seed)
    # distinct even in bf16 (spaced 4 / E apart), so that without ties the ids must agree
    logits = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(num_tokens)]).float()
    logits = logits * (4.0 / num_experts) - 2.0
    if ties:  # pairs of equal logits, so equal probabilities compete for the last places
        logits[:, 1::2] = logits[:, 0::2]
    logits = logits.to(device, dtype)
    w_ref, id_ref = topk_softmax_torch(logits, top_k, renormalize)
    w, ids = topk_softmax_triton(logits, top_k, renormalize)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    probs = torch.softmax(logits.float(), dim=-1)
    # the chosen experts carry the weights they were chosen for (ties may pick either twin)
    torch.testing.assert_close(probs.gather(1, ids) if not renormalize else w, w_ref, atol=1e-6, rtol=1e-5)
    if not ties:
        assert torch.equal(ids, id_ref)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "an expert chosen twice"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256, 128, 16, 4), (300, 512, 256, 32, 8), (5000, 256, 128, 16, 2)])
@pytest.mark.parametrize("skew", ["uniform", "hot", "one-empty"])
def test_fused_experts(dtype, shape, skew):
    check_fused_experts("cuda", dtype, *shape, skew=skew)


@pytest.mark.parametrize("ep_ranks", [2, 4])
def test_fused_experts_expert_parallel(ep_ranks):
    check_fused_experts("cuda", torch.bfloat16, 64, 256, 128, 16, 4, skew="hot", ep_ranks=ep_ranks)
    check_fused_experts("cuda", torch.float32, 3, 128, 64, 8, 2, ties=True, ep_ranks=ep_ranks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 8), (2, 2), (4, 8)])
@pytest.mark.parametrize("ep_ranks", [1, 2])
def test_fused_experts_small(dtype, num_tokens, top_k, ep_ranks):
    """The small-batch kernels at Qwen3-30B-A3B-like tiles, default and a narrow and a wide sweep point;
    the down kernel one expert a program (its default), two, and all of a token's (no counters). Each
    twice in a row: the second call finds the counters the first left at zero."""
    # the wide point fits float32's shared memory (2 stages)
    for tiles in (None, ((16, 64, 4, 3), (32, 128, 4, 3, 2)), ((64, 128, 4, 2), (64, 128, 8, 2)),
                  ((32, 128, 4, 3), (16, 256, 1, 3, 8))):
        check_fused_experts("cuda", dtype, num_tokens, 512, 192, 32, top_k, skew="hot", ep_ranks=ep_ranks,
                            path="small", tiles=tiles, calls=2)
    check_fused_experts("cuda", dtype, 4, 256, 64, 16, 2, skew="repeat", path="small")


def test_small_path_replays_in_cuda_graph():
    """Captured once at 2 tokens (the small path: 16 pairs), replayed twice on new inputs and routing:
    the reference's output, and each replay adds its pairs to the load counters. The down kernel's
    counters (shared by eager calls and replays) are zero again after each: an eager call after the
    replays is right too."""
    from pagedllm.kernels.fused_moe import fused_experts_torch
    from pagedllm.kernels.fused_moe_triton import fused_experts_triton

    x, w13, w2, weights, ids = _inputs("cuda", torch.bfloat16, 2, 256, 64, 32, 8, 0, "uniform")
    load = torch.zeros(32, dtype=torch.int64, device="cuda")
    slots = torch.tensor([5, -1], device="cuda")
    fused_experts_triton(x, w13, w2, weights, ids, None, load, slots)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, w13, w2, weights, ids, None, load, slots)
    load.zero_()
    expected = torch.zeros(32, dtype=torch.int64)
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = _inputs("cuda", torch.bfloat16, 2, 256, 64, 32, 8, seed, "hot")
        for static, new in ((x, x2), (weights, weights2), (ids, ids2)):
            static.copy_(new)
        graph.replay()
        ref = fused_experts_torch(x, w13, w2, weights, ids)
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16][0], rtol=TOL[torch.bfloat16][1])
        expected += torch.bincount(ids2[0].cpu(), minlength=32)
    assert torch.equal(load.cpu(), expected)
    x3, _, _, weights3, ids3 = _inputs("cuda", torch.bfloat16, 2, 256, 64, 32, 8, 3, "hot")
    eager = fused_experts_triton(x3, w13, w2, weights3, ids3)
    ref = fused_experts_torch(x3, w13, w2, weights3, ids3)
    torch.testing.assert_close(eager.float(), ref.float(), atol=TOL[torch.bfloat16][0], rtol=TOL[torch.bfloat16][1])


@pytest.mark.parametrize("args", [(1, 128, 8, 16), (33, 60, 4, 16), (200, 16, 2, 64), (2000, 128, 8, 16)])
@pytest.mark.parametrize("ep_ranks", [1, 2])
def test_align(args, ep_ranks):
    check_align("cuda", torch.int64, *args, ep_ranks=ep_ranks)
    check_align("cuda", torch.int32, *args, ep_ranks=ep_ranks)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(ties, renormalize):
    check_topk_softmax("cuda", torch.bfloat16, 37, 128, 8, renormalize, ties)
    check_topk_softmax("cuda", torch.float32, 5, 60, 4, renormalize, ties)
