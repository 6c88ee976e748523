"""The MoE kernels alone at a model's shapes, each timed in a CUDA graph as decode steps run
them (benchmarks/moe_bench.py's kernel part): the experts' grouped and small-batch paths, the
small path's tile sweep, and the router with its top-k."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


# ---- 1. the experts alone ----------------------------------------------------------------------
def time_layers(fns, replays: int = 30) -> float:
    """Device microseconds per call of fns (one call each per "layer", all captured in one CUDA
    graph, replayed): each reads other experts than the call before it, as the next layer does,
    so a call's weights are not still in the L2 (50 MB) from the replay before."""

    def run():
        for f in fns:
            f()

    return common.graph_time(run, calls=len(fns), reps=replays)


def _layer_inputs(t: int, h: int, e: int, k: int, g, dtype, layers: int = 8):
    """(x [T, H], topk weights [T, K], topk ids [T, K]) of `layers` calls, each routed at random."""
    dev = g.device
    return [(torch.randn(t, h, device=dev, dtype=dtype, generator=g), torch.rand(t, k, device=dev, generator=g),
             torch.rand(t, e, device=dev, generator=g).topk(k, dim=1).indices) for _ in range(layers)]


def kernel_timings(cfg, log) -> list[dict]:
    from pagedllm.kernels.fused_moe_triton import fused_experts_grouped, fused_experts_triton

    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    per_expert_bytes = 3 * i * h * 2
    rows = []
    for t in (1, 8, 64, 256):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1).indices
        w = torch.rand(t, k, device="cuda", generator=g)
        touched = int(torch.unique(ids).numel())
        # "auto": fused_experts_triton's choice (the small path up to SMALL_MAX_PAIRS pairs)
        configs = ["auto", None]
        if t == 1:
            configs += [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                        for bn, bk, nw, ns in ((64, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4), (64, 64, 4, 5),
                                               (32, 128, 4, 5), (16, 128, 4, 6))]
        for c in configs:
            if c == "auto":
                fn = lambda x=x, w=w, ids=ids: fused_experts_triton(x, w13, w2, w, ids)  # noqa: E731
            else:
                fn = lambda c=c, x=x, w=w, ids=ids: fused_experts_grouped(x, w13, w2, w, ids, config=c)  # noqa: E731
            try:
                us = common.graph_time(fn, reps=50)
            except Exception as ex:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                log(f"  experts T={t} config {c}: failed: {type(ex).__name__}: {ex}")
                continue
            gbps = touched * per_expert_bytes / us / 1e3
            label = c if c == "auto" else f"grouped {c or 'default'}"
            row = {"tokens": t, "config": label, "us": round(us, 1), "experts_read": touched,
                   "weight_GB_per_s": round(gbps, 0)}
            rows.append(row)
            log(f"  experts T={t:>3} {str(label):<88} {us:8.1f} us  {touched:>3} experts read  {gbps:7.0f} GB/s")
    return rows


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the small path's sweep (fused_moe_small_triton.py)
# (the eleventh session's sweep improved with the tile's width up to 64, its widest: 17.3 / 15.8 /
# 14.5 us at 16 / 32 / 64 at 1 token, so wider ones and more warps are tried too)
SMALL_GATE_UP_TILES = [(16, 128, 4, 4), (16, 256, 4, 3), (16, 128, 2, 6), (32, 128, 4, 4), (32, 256, 4, 3),
                       (32, 64, 4, 8), (64, 128, 4, 4), (64, 64, 4, 6), (64, 128, 8, 4), (64, 256, 4, 3),
                       (128, 64, 4, 4), (128, 128, 8, 3)]
# the down kernel's, with its experts a program last: 1 (programs split over the k experts, the
# last of a token's n tile adds their products), 2, and all 8 (one program walks the token's
# experts, as the kernel did before the split: its best tile then, 16.4 us at 1 token)
SMALL_DOWN_TILES = [(16, 256, 1, 4, 1), (16, 256, 1, 3, 1), (16, 256, 2, 4, 1), (16, 128, 1, 4, 1),
                    (16, 128, 2, 4, 1), (32, 256, 1, 4, 1), (32, 256, 2, 4, 1), (32, 128, 4, 4, 1),
                    (64, 128, 4, 3, 1), (64, 256, 4, 3, 1), (16, 256, 1, 4, 2), (16, 256, 1, 4, 8)]


def small_sweep(cfg, log, token_counts=(1, 2, 4, 8), device: str = "cuda", dtype=torch.bfloat16) -> list[dict]:
    """The small-batch path against the grouped one at a few tokens, and its tiles: each kernel
    alone over SMALL_*_TILES (the other at its default), then both at the best of each. Every
    configuration is first checked against fused_experts_torch; one that differs is not timed.
    Each timing is 8 calls of one layer's experts with their own random routing (time_layers).
    (device and dtype: for a dry run of this code on the CPU under Triton's interpreter.)"""
    from pagedllm.kernels import fused_moe_small_triton as small

    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device=device).manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=dtype, generator=g) * 0.02
    w2 = torch.randn(e, h, i, device=device, dtype=dtype, generator=g) * 0.02
    rows: list[dict] = []
    log(f"  small path sweep (SMALL_MAX_PAIRS = {small.SMALL_MAX_PAIRS}; defaults gate/up {small.DEFAULT_GATE_UP}, "
        f"down {small.DEFAULT_DOWN_ONE_TOKEN} at 1 token, {small.DEFAULT_DOWN} from 2); us per layer, GB/s of the "
        f"expert weights read")
    for t in token_counts:
        _small_sweep_at(t, cfg, w13, w2, g, log, rows)
    log("  summary: us per layer (grouped | small default | small best)")
    for t in token_counts:
        got = {r["path"]: r["us"] for r in rows if r["tokens"] == t and r["path"] in ("grouped", "small", "small best")}
        log(f"  T={t:>2}: {got.get('grouped', '-'):>8} | {got.get('small', '-'):>8} | {got.get('small best', '-'):>8}")
    return rows


def _small_sweep_at(t: int, cfg, w13, w2, g, log, rows: list[dict]) -> None:
    from pagedllm.kernels import fused_moe_small_triton as small
    from pagedllm.kernels.fused_moe import fused_experts_torch
    from pagedllm.kernels.fused_moe_triton import fused_experts_grouped

    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    calls = _layer_inputs(t, h, e, k, g, w13.dtype)
    touched = sum(int(torch.unique(ids).numel()) for _, _, ids in calls) / len(calls)
    x0, w0, ids0 = calls[0]
    ref = fused_experts_torch(x0, w13, w2, w0, ids0).float()
    scale = ref.abs().max().item()

    def run(label, kind, tiles, make, check) -> float | None:
        # make(x, w, ids) -> the call of one layer; check() -> the output of calls[0]
        err = (check().float() - ref).abs().max().item() / scale
        if not err < 2e-2:
            log(f"  T={t} {label} {tiles}: differs from the torch reference (max error {err:.2e} of the max)")
            return None
        try:
            us = time_layers([make(*c) for c in calls])
        except Exception as ex:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
            log(f"  T={t} {label} {tiles}: failed: {type(ex).__name__}: {ex}")
            return None
        gbps = touched * 3 * i * h * 2 * {"experts": 1, "gate_up": 2 / 3, "down": 1 / 3}[kind] / us / 1e3
        rows.append({"tokens": t, "path": label, "tiles": tiles, "us": round(us, 2), "GB_per_s": round(gbps)})
        log(f"  T={t} {label:<14} {str(tiles):<36} {us:8.2f} us {gbps:7.0f} GB/s  (max error {err:.1e})")
        return us

    def whole(gu=None, dn=None):  # None: the defaults for t tokens
        return lambda x, w, ids: lambda: small.fused_experts_small(x, w13, w2, w, ids, gate_up_tiles=gu, down_tiles=dn)

    run("grouped", "experts", "default", lambda x, w, ids: lambda: fused_experts_grouped(x, w13, w2, w, ids),
        lambda: fused_experts_grouped(x0, w13, w2, w0, ids0))
    run("small", "experts", "default", whole(), lambda: whole()(x0, w0, ids0)())
    best: dict = {}
    for tiles in SMALL_GATE_UP_TILES:
        us = run("small gate_up", "gate_up", tiles,
                 lambda x, w, ids, tiles=tiles: lambda: small.small_gate_up(x, w13, ids, None, None, None, tiles),
                 lambda tiles=tiles: whole(gu=tiles)(x0, w0, ids0)())
        if us is not None and us < best.get("gate_up", (None, float("inf")))[1]:
            best["gate_up"] = (tiles, us)
    for tiles in SMALL_DOWN_TILES:
        def make(x, w, ids, tiles=tiles):
            hid = small.small_gate_up(x, w13, ids, None, None, None)  # [T * K, I], before the capture
            return lambda: small.small_down(hid, w2, w, ids, None, tiles)

        us = run("small down", "down", tiles, make, lambda tiles=tiles: whole(dn=tiles)(x0, w0, ids0)())
        if us is not None and us < best.get("down", (None, float("inf")))[1]:
            best["down"] = (tiles, us)
    if len(best) == 2:
        gu, dn = best["gate_up"][0], best["down"][0]
        us = run("small best", "experts", (gu, dn), whole(gu, dn), lambda: whole(gu, dn)(x0, w0, ids0)())
        log(f"  T={t} best: gate/up {gu} {best['gate_up'][1]:.2f} us + down {dn} {best['down'][1]:.2f} us; "
            f"both in one graph {us} us")


def router_timings(cfg, log, token_counts=(1, 2, 4), layers: int = 48) -> list[dict]:
    """--router-ab (see the module docstring): us per layer of each way to route."""
    from pagedllm.kernels import small_m
    from pagedllm.kernels.fused_moe_triton import topk_softmax_triton

    e, h, k = cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok
    renorm = bool(getattr(cfg, "norm_topk_prob", True))
    g = torch.Generator(device="cuda").manual_seed(2)
    gates = [torch.randn(e, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(layers)]
    rows = []
    log(f"  router + top-{k} of {e} experts (hidden {h}, renormalize {renorm}), {layers} layers a graph; us per layer")
    for t in token_counts:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        config = small_m.default_config(t, e, h)
        ways = {
            "cublas + topk": lambda w, x=x: topk_softmax_triton(torch.mm(x, w.t(), out_dtype=torch.float32), k,
                                                                renorm),
            "swap + topk": lambda w, x=x: topk_softmax_triton(small_m.small_m_linear(x, w, None, torch.float32), k,
                                                              renorm),
            "fused": lambda w, x=x: small_m.route_small(x, w, k, renorm)[1:],
        }
        _, ids = ways["swap + topk"](gates[0])
        _, fused_ids = ways["fused"](gates[0])
        assert torch.equal(ids, fused_ids), f"T={t}: the fused router picks other experts"
        line = []
        for name, way in ways.items():
            try:
                us = time_layers([lambda w=w, way=way: way(w) for w in gates])
            except (RuntimeError, TypeError) as ex:  # a torch without mm's out_dtype
                log(f"  T={t} {name}: failed: {type(ex).__name__}: {str(ex)[:100]}")
                continue
            rows.append({"tokens": t, "way": name, "us": round(us, 2), "config": str(config)})
            line.append(f"{name} {us:6.2f}")
        log(f"  T={t}: " + "   ".join(line))
    return rows


# ---- 2. pagedllm --------------------------------------------------------------------------------
