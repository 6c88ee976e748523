"""FP8 linears on CUDA, timed the way decode steps run them: inside a CUDA graph, each of 32
layers with its own weights (so no weight is served from L2), for Llama-3.1-8B's four projection
shapes and row counts 1 .. 256. Compared: bf16 `F.linear`, `torch._scaled_mm` W8A8 with its
per-token activation quantization, `fp8_linear` (main's dispatch), the Triton W8A16 kernels: the
kernel main used before the swap-AB one ("old"), the default config, and a sweep of others.
Checks each Triton config against the torch reference first. Prints per shape and
row count the times per layer, and the sum over the four shapes and 32 layers; with $OUT set,
writes $OUT/fp8_bench.json.

    PYTHONPATH=. python benchmarks/fp8_bench.py [--rows 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from pagedllm.kernels.fp8 import _scaled_mm, fp8_linear, fp8_linear_torch, quantize_fp8_torch  # noqa: E402
from pagedllm.kernels.fp8_triton import default_config, fp8_gemm_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
EXTRA_SHAPES = {"lm_head": (128256, 4096)}  # once a step, not per layer: left out of the sums
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LAYERS = 32


def old_config(m: int) -> tuple:
    """The kernel main ran before the swap-AB kernel (commit 68b4f7d: the CUDA-core GEMV to 3
    rows with one tile for every shape, tl.dot after)."""
    if m == 1:
        return ("gemv", 1, 8, 512, 8, 3)
    if m <= 3:
        return ("gemv", 1, 8, 256, 4, 2)
    return ("dot", 16 if m <= 16 else (32 if m <= 32 else 64), 32, 256, 4, 3)


def sweep(m: int, full: bool) -> list[tuple]:
    cfgs = []
    if m == 1:  # the swap-AB kernel's best of the first H200 sweep at one row (the GEMV wins there)
        cfgs += [("swap", 16, 64, 128, 4, 3, 4), ("swap", 16, 128, 128, 4, 3, 1), ("swap", 16, 32, 512, 4, 3, 1)]
    elif m <= 16:  # the swap-AB tensor-core kernel
        for bn in (16, 32, 64, 128):
            for bk in (128, 256, 512):
                for st in ((2, 3, 4) if full else (3,)):
                    for split in (1, 2, 4):
                        if bn * bk <= 128 * 256 or (bn <= 32 and bk <= 512):
                            cfgs.append(("swap", 16, bn, bk, 4, st, split))
                cfgs.append(("swap", 16, bn, bk, 8, 3, 1))
    if m == 1:
        cfgs += [("gemv", 1, bn, bk, w, 2) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024, 2048)
                 for w in (4, 8) if 2048 <= bn * bk <= 16 * 1024]
        # the unrolled GEMV: UNROLL tiles in flight, a [BLOCK_N] accumulator
        cfgs += [("gemv_unrolled", 1, bn, bk, w, 1, u) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
                 for u in (2, 4) for w in (4, 8) if 4096 <= bn * bk * u <= 32 * 1024 and bk * u <= 4096]
    elif m <= 3:
        cfgs += [("gemv", 1, bn, bk, w, 3) for bn in (4, 8, 16) for bk in (256, 512) for w in (4, 8)]
    elif m > 16:
        bm = 32 if m <= 32 else 64
        cfgs += [("dot", bm, bn, bk, 4, st) for bn in (32, 64, 128) for bk in (128, 256) for st in (3, 4)]
    return cfgs


def graph_time(fn, reps: int = 20, rounds: int = 5) -> float:
    """us per call of fn (which runs LAYERS products), replayed from a CUDA graph."""
    return common.graph_time(fn, LAYERS, reps, rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=[*SHAPES, *EXTRA_SHAPES])
    ap.add_argument("--kinds", nargs="*", default=None, help="sweep only these kernel kinds (e.g. gemv_unrolled)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--full-sweep", action="store_true", help="also sweep the pipeline depth")
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    results: dict[str, dict] = {}
    for name in args.shapes:
        n, k = {**SHAPES, **EXTRA_SHAPES}[name]
        ws = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        qs = [quantize_fp8_torch(w) for w in ws]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = fp8_linear_torch(x, *qs[0])
            row: dict = {"bf16": graph_time(lambda: [torch.nn.functional.linear(x, w) for w in ws]),
                         "scaled_mm": graph_time(lambda: [_scaled_mm(x, q, s, None) for q, s in qs]),
                         "dispatch": graph_time(lambda: [fp8_linear(x, q, s) for q, s in qs])}
            swept = [] if args.no_sweep else [c for c in sweep(m, args.full_sweep)
                                              if (args.kinds is None or c[0] in args.kinds)
                                              and (c[0] != "gemv_unrolled" or k % (c[3] * c[6]) == 0)]
            cfgs = [old_config(m), default_config(m, n, k, 0)] + swept
            best = None
            timed = []
            for i, cfg in enumerate(cfgs):
                out = fp8_gemm_triton(x, *qs[0], config=cfg)
                err = (out.float() - ref.float()).abs().max().item()
                if err > 0.03 * ref.float().abs().max().item() + 1e-2:
                    raise AssertionError(f"{name} m={m} {cfg}: max error {err}")
                t = graph_time(lambda: [fp8_gemm_triton(x, q, s, config=cfg) for q, s in qs],
                               reps=20 if i < 2 else 10, rounds=5 if i < 2 else 3)
                if i == 0:
                    row["old"], row["old_cfg"] = t, cfg
                elif i == 1:
                    row["triton_default"], row["default_cfg"] = t, cfg
                timed.append((t, cfg))
                if best is None or t < best[0]:
                    best = (t, cfg)
            row["triton_best"], row["best_cfg"] = best
            gbs = n * k / (row["triton_default"] * 1e-6) / 1e9
            print(f"{name:8s} m={m:4d} us/layer: bf16 {row['bf16']:6.1f}  scaled_mm {row['scaled_mm']:6.1f}  "
                  f"old {row['old']:6.1f}  default {row['triton_default']:6.1f} ({gbs:5.0f} GB/s) "
                  f"{row['default_cfg']}  fp8_linear {row['dispatch']:6.1f}  best {row['triton_best']:6.1f} "
                  f"{row['best_cfg']}", flush=True)
            for kind in ("gemv", "gemv_unrolled", "swap", "dot"):
                top = sorted(tc for tc in timed[2:] if tc[1][0] == kind)[:3]
                if top:
                    print(f"    top {kind}: " + "  ".join(f"{t:.1f} {c[2:]}" for t, c in top))
            row["timed"] = timed
            results[f"{name}:{m}"] = row
        del ws, qs
        torch.cuda.empty_cache()
    if set(args.shapes) == set(SHAPES):
        print(f"\nsum over the four projections x {LAYERS} layers, ms per step (CUDA graph; fp8_linear = "
              "main's dispatch, old = the kernel before the swap-AB one):")
        keys = ("bf16", "scaled_mm", "old", "triton_default", "dispatch", "triton_best")
        print(f"{'rows':>5} " + " ".join(f"{key:>14}" for key in keys) + f" {'bf16/fp8_linear':>16}")
        for m in args.rows:
            tot = {key: LAYERS * sum(results[f"{nm}:{m}"][key] for nm in SHAPES) / 1000 for key in keys}
            print(f"{m:5d} " + " ".join(f"{tot[key]:14.3f}" for key in keys) + f" {tot['bf16'] / tot['dispatch']:15.2f}x")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fp8_bench.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
