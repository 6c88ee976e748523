"""The residual stream's fusions (LlamaDecoderLayer.forward_stream) kernel by kernel, on CUDA, at
Qwen3-30B-A3B's batch-1 shapes: us per layer in a CUDA graph of 48 layers with their own weights
(fp8_bench.py's `graph_time`; with PDL on, as the engine launches them). Each fused chain is
checked against the unfused one first (a sanity check: tests/gpu/ hold the real ones).

- qkv: add + RMSNorm, the swap-AB qkv product, q/k norm + rotary + store (3 kernels) against the
  product normalizing its input + the rope kernel (2) and the qkv product with the rope in its
  epilogue (1), the last at a few split-K / K-step configs;
- o: the o product, then add + RMSNorm (2) against the o product adding the residual (1; the
  norm goes to the next products' prologues);
- moe: RMSNorm, the fused router, the small gate/up and down kernels, the add (5 in the unfused
  stream: the add is the next layer's norm) against the router and gate/up normalizing and the
  down kernel adding (3).

    PYTHONPATH=. python benchmarks/stream_bench.py [--rows 1 4]   # with $OUT: $OUT/stream_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from pagedllm.kernels import small_m  # noqa: E402
from pagedllm.kernels.fused_moe_small_triton import fused_experts_small  # noqa: E402
from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from pagedllm.kernels.qkv_gemm_rope_triton import qkv_gemm_config, qkv_gemm_rope_triton  # noqa: E402
from pagedllm.kernels.qkv_rope_triton import qkv_norm_rope_store_triton  # noqa: E402
from pagedllm.kernels.swap_gemm_triton import SwapConfig  # noqa: E402

DEV = "cuda"
LAYERS = 48
HIDDEN, HQ, HKV, D, EXPERTS, TOP_K, INTER = 2048, 32, 4, 128, 128, 8, 768
EPS = 1e-6


def graph_time(fn) -> float:
    return common.graph_time(fn, LAYERS, 20, 5)


def _close(a, b, what):
    torch.testing.assert_close(a.float(), b.float(), atol=6e-2, rtol=4e-2, msg=lambda m: f"{what}: {m}")


def bench_qkv(rows: int, g) -> dict:
    n = (HQ + 2 * HKV) * D
    ws = [torch.randn(n, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    nw = torch.ones(HIDDEN, device=DEV, dtype=torch.bfloat16)
    qw = kw = torch.ones(D, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(rows, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16)
    res = torch.randn(rows, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16)
    s = x + res
    pos = torch.arange(100, 100 + rows, device=DEV)
    slots = torch.arange(rows, device=DEV)
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEV).float() / D)
    ang = torch.outer(torch.arange(4096, device=DEV, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    kc = torch.zeros(4, 16, HKV, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    cfg = small_m.default_config(rows, n, HIDDEN)

    def unfused(w):
        h, _ = fused_add_rms_norm_triton(x, res, nw, EPS)
        qkv = small_m.small_m_linear(h, w, config=cfg)
        return qkv_norm_rope_store_triton(qkv, pos, cos, sin, kc, vc, slots, HQ, HKV, D, qw, kw, EPS)

    def norm_prologue(w):
        qkv = small_m.small_m_linear(s, w, config=cfg, norm=(nw, EPS))
        return qkv_norm_rope_store_triton(qkv, pos, cos, sin, kc, vc, slots, HQ, HKV, D, qw, kw, EPS)

    def epilogue(w, c=None):
        return qkv_gemm_rope_triton(s, w, None, (nw, EPS), pos, cos, sin, kc, vc, slots, HQ, HKV, D, qw, kw, EPS,
                                    config=c)  # fmt: skip

    ref = unfused(ws[0])
    _close(norm_prologue(ws[0]), ref, "qkv, norm prologue")
    _close(epilogue(ws[0]), ref, "qkv, rope epilogue")
    out = {"unfused (3 kernels)": graph_time(lambda: [unfused(w) for w in ws]),
           "norm prologue (2)": graph_time(lambda: [norm_prologue(w) for w in ws])}
    default = qkv_gemm_config(rows, n, HIDDEN, D)
    for c in [default] + [SwapConfig(D, bk, sk, 4, st) for bk, sk, st in ((128, 1, 4), (256, 1, 3), (128, 4, 3),
                                                                           (64, 2, 4), (256, 2, 3))]:
        label = f"rope epilogue (1) {c.block_k}/{c.split_k}/{c.num_stages}" + (" default" if c == default else "")
        if label.replace(" default", "") in {k.replace(" default", "") for k in out}:
            continue
        out[label] = graph_time(lambda c=c: [epilogue(w, c) for w in ws])
    return out


def bench_o(rows: int, g) -> dict:
    ws = [torch.randn(HIDDEN, HQ * D, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    nw = torch.ones(HIDDEN, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(rows, HQ * D, device=DEV, generator=g, dtype=torch.bfloat16)
    res = torch.randn(rows, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16)
    cfg = small_m.default_config(rows, HIDDEN, HQ * D)

    def unfused(w):
        return fused_add_rms_norm_triton(small_m.small_m_linear(a, w, config=cfg), res, nw, EPS)[1]

    def fused(w):
        return small_m.small_m_linear(a, w, config=cfg, residual=res)

    _close(fused(ws[0]), unfused(ws[0]), "o + residual")
    return {"o + add-norm (2 kernels)": graph_time(lambda: [unfused(w) for w in ws]),
            "o adding the residual (1)": graph_time(lambda: [fused(w) for w in ws])}


def bench_moe(rows: int, g) -> dict:
    layers = []
    for _ in range(LAYERS // 6):  # 8 distinct expert sets (1.2 GB each) cycled: a set's experts are out
        # of the L2 (50 MB) before it comes round again
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
        gate = torch.randn(EXPERTS, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
        layers.append((w13, w2, gate))
    layers = (layers * 6)[:LAYERS]
    nw = torch.ones(HIDDEN, device=DEV, dtype=torch.bfloat16)
    s = torch.randn(rows, HIDDEN, device=DEV, generator=g, dtype=torch.bfloat16)

    def unfused(w13, w2, gate):
        h = rms_norm_triton(s, nw, EPS)
        _, weights, ids = small_m.route_small(h, gate, TOP_K, True)
        return fused_experts_small(h, w13, w2, weights, ids) + s

    def fused(w13, w2, gate):
        _, weights, ids = small_m.route_small(s, gate, TOP_K, True, norm=(nw, EPS))
        return fused_experts_small(s, w13, w2, weights, ids, norm=(nw, EPS), residual=s)

    _close(fused(*layers[0]), unfused(*layers[0]), "moe")
    return {"norm, router, experts, add (5 kernels)": graph_time(lambda: [unfused(*lw) for lw in layers]),
            "router and experts folding them (3)": graph_time(lambda: [fused(*lw) for lw in layers])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4])
    args = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    results: dict[str, dict] = {}
    for rows in args.rows:
        for name, bench in (("qkv", bench_qkv), ("o", bench_o), ("moe", bench_moe)):
            results[f"{name}:{rows}"] = r = bench(rows, g)
            for label, us in r.items():
                print(f"{name:4s} rows {rows:2d}  {label:42s} {us:7.2f} us a layer", flush=True)
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "stream_bench.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
