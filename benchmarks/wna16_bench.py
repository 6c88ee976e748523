"""Integer weight-only linears (W4A16, W8A16) on CUDA, timed like fp8_bench.py: inside a CUDA
graph, 32 layers with distinct weights (none served from L2), Llama-3.1-8B's four projection
shapes, int4 symmetric in groups of 128 (the dummy weights' format). Compared per row count:
bf16 `F.linear`, the Triton kernels (default config, then the sweep), and the prefill path
(dequantize + cuBLAS). Every config is checked against the torch reference before it is
timed; a config that fails to compile is reported and skipped. Prints per shape and row count
the best config and the GB/s of weights it reaches, then the sum over the four shapes and 32
layers; with $OUT set, writes $OUT/wna16_bench.json.

    PYTHONPATH=. python benchmarks/wna16_bench.py [--rows 1 16 64 256] [--no-sweep]

--swap times the 4-bit swap-AB tensor-core kernel of the N-major layout instead (wna16_swap_bench.py,
whose docstring says what it prints), at 1 / 4 / 16 rows by default:

    PYTHONPATH=. python benchmarks/wna16_bench.py --swap [--rows 1 4 16] [--group 128] [--budget-s 90]
    PYTHONPATH=. python benchmarks/wna16_bench.py --swap --rows 64 256 --skip-check   # the W4A16 GEMM

Checks and timing shared by both: wna16_timing.py.

--kperm also times the engine's dispatch (`wna16_linear`) on the plain K-packed layout and on the
steps-permuted one (PAGEDLLM_WNA16_KPERM: kpairs reads x as it is, no gather), per shape and row count:

    PYTHONPATH=. python benchmarks/wna16_bench.py --kpairs-only --no-sweep --skip-check --kperm --rows 1 16 64 160 256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_bench import LAYERS, SHAPES, graph_time  # noqa: E402
from wna16_timing import WRONG, check, fields, time_configs, time_default_and_best  # noqa: E402

from pagedllm.kernels.wna16 import (  # noqa: E402
    kperm_pack,
    quantize_wna16_torch,
    wna16_linear,
    wna16_linear_torch,
)
from pagedllm.kernels.wna16_kpairs_triton import default_config as kpairs_default  # noqa: E402
from pagedllm.kernels.wna16_kpairs_triton import wna16_kpairs_gemm  # noqa: E402
from pagedllm.kernels.wna16_triton import dequantize_wna16_triton, wna16_gemm_triton  # noqa: E402
from pagedllm.kernels.wna16_triton import engine_config as wna16_engine_config  # noqa: E402

ROWS = [1, 16, 64, 256]


def sweep(m: int, k: int, bits: int = 4) -> list[tuple]:
    if m <= 4:
        # gemvp (the packed 16-bit GEMV, the engine's one for 16-bit rows): 32 / 64 columns, tiles of
        # 512 / 1,024 inputs, 8 warps, split-K 1-4 (more programs an SM: more loads in flight)
        # while each split keeps two tiles; 2 stages: the next tile's words in registers, 3 / 4:
        # Triton's software pipeline (cp.async, wna16_triton.gemv_prefetch). 8 bits: the float32 gemv's
        # tiles and split-K (it has no stages)
        if bits != 4:
            cfgs = [("gemv", 1, bn, bk, 8, 2, s) for bn in (32, 64) for bk in (512, 1024) for s in (1, 2, 4)]
        else:
            cfgs = [("gemvp", 1, bn, bk, 8, 2, s) for bn in (32, 64) for bk in (512, 1024) for s in (1, 2, 4)]
            cfgs += [("gemvp", 1, bn, 1024, 8, 3, s) for bn in (32, 64) for s in (1, 2, 4)]
            cfgs += [("gemvp", 1, 32, 512, 8, 4, s) for s in (1, 2, 4)]
            # deeper pipelines (5-7 tiles ahead: a 4,096-input projection's whole K range of 512-input
            # tiles in flight at once; sm_90 with Triton 3.6: 40-57 registers, 67-186 KB of shared
            # memory, no spills): the small projections are latency-bound (qkv / o at 35-40% of the
            # H100's bandwidth, RESULTS.md eighteenth session)
            cfgs += [("gemvp", 1, 32, 512, 8, st, s) for st in (6, 8) for s in (1, 2)]
            cfgs += [("gemvp", 1, 64, 512, 8, st, 1) for st in (4, 6)] + [("gemvp", 1, 32, 1024, 8, 6, 1)]
        return [c for c in cfgs if k >= 2 * c[3] * c[6]]
    # "dotj" (each word loaded once, wna16_triton.py) beside "dot"; its 128 x 256 tiles spill on sm_90
    if m <= 16:
        return [("gemv", 1, 64, 512, 4, 2, 1)] + [(kind, 16, bn, bk, 4, st, 1) for kind in ("dot", "dotj")
                                                  for bn in (32, 64, 128) for bk, st in ((64, 4), (128, 3))]
    if m <= 64:
        return [(kind, bm, bn, 64, w, 3, 1) for kind in ("dot", "dotj") for bm in (32, 64) for bn in (64, 128)
                for w in (4, 8)]
    return [("dot", bm, bn, bk, w, 3, 1) for bm in (64, 128) for bn in (128, 256) for bk in (64, 128)
            for w in (4, 8)] + [("dot", 128, 64, 64, 4, 4, 1)] + [
        ("dotj", bm, 128, bk, w, st, 1) for bm in (64, 128) for bk in (64, 128) for w in (4, 8) for st in (3, 4)]


def engine_config(m: int, n: int, k: int, bits: int) -> tuple:
    """The config the engine runs for bf16 rows of int4 / int8 weights in groups of 128."""
    return wna16_engine_config(m, n, k, 128, bits, torch.bfloat16)


def correctness(dev: str) -> None:
    """Random inputs of several shapes, group sizes, both symmetries, 4 and 8 bits, both dtypes."""
    g = torch.Generator(device=dev).manual_seed(1)
    worst = 0.0
    cases = 0
    for bits in (4, 8):
        for gk in (32, 64, 128, None):
            for sym in (True, False):
                for i, (m, n, k) in enumerate(((1, 4096, 4096), (3, 6144, 1024), (16, 1024, 14336), (300, 512, 1024))):
                    for dtype in ((torch.bfloat16, torch.float16)[(i + bits + int(sym)) % 2],):
                        w = torch.randn(n, k, device=dev, generator=g) * 0.02
                        qw, s, z = quantize_wna16_torch(w, bits, gk, sym, torch.float16)
                        x = torch.randn(m, k, device=dev, generator=g).to(dtype)
                        bias = torch.randn(n, device=dev, generator=g).to(dtype)
                        ref = wna16_linear_torch(x, qw, s, z, bits, bias)
                        worst = max(worst, check(wna16_gemm_triton(x, qw, s, z, bits, bias), ref,
                                                 f"bits={bits} g={gk} sym={sym} {m}x{n}x{k} {dtype}"))
                        dense = x.float() @ dequantize_wna16_triton(qw, s, z, bits, torch.float32) + bias.float()
                        worst = max(worst, check(dense, ref, f"dequant bits={bits} g={gk} sym={sym}"))
                        cases += 1
    print(f"correctness: {cases} cases (bits 4/8, groups 32/64/128/channel, sym/asym, bf16/fp16, "
          f"M 1..300), worst max error {worst:.4f} of the reference's max", flush=True)


def kpairs_sweep(m: int, k: int) -> list:
    """kpairs configs around its default: 64 (4 warps) or 128 (8 warps) activation rows, 128-wide
    weight tiles, K steps of 128, split-K 1-4; and 256 rows (8 warps) from 129 rows; under 33 rows 16-
    and 32-row tiles (4 warps, split-K to 8) too, over 64 rows 64-wide weight tiles of 128 rows; four
    accumulators in the tiles that fit them; one dot an iteration in the 8-warp ones; two accumulators
    in those of up to 128 rows."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    small = [(bm, 4) for bm in (16, 32) if m <= bm]
    one = [SwapConfig(128, 128, split, warps, 3, block_m=bm, pairs=True)
           for bm, warps in (*small, (64, 4), (128, 8), (256, 8)) if bm <= max(64, 2 * m - 2)
           for split in ((1, 2, 4, 8) if bm <= 32 else (1, 2, 4)) if k >= 2 * 128 * split]
    # 64-wide weight tiles of 128 rows, chained (8 warps; sm_90: 147 registers): twice the programs of
    # the narrow projections' 128-wide ones (qkv: 96 of them at 65-128 rows fill 73% of 132 SMs)
    narrow = [SwapConfig(64, 128, split, 8, 3, block_m=128, pairs=True) for split in (1, 2)
              if m > 64 and k >= 2 * 128 * split]
    # four accumulators (SwapConfig.dots): 64-wide weight tiles of 128 rows, 128-wide of 64 rows
    accs = [SwapConfig(bn, 128, split, 8, 3, block_m=bm, pairs=True, dots="accs")
            for bn, bm in ((64, 128), (128, 64)) if bm <= max(64, 2 * m - 2)
            for split in (1, 2, 4) if k >= 2 * 128 * split]
    # two accumulators in the chained tiles of up to 128 rows
    accs2 = [dataclasses.replace(c, dots="accs2") for c in one if c.block_m <= 128]
    return one + narrow + accs + accs2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS, help="4-bit: from 2 rows the kpairs GEMM is timed too")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--kpairs-only", action="store_true",
                    help="sweep only the kpairs GEMM (the Triton GEMV/GEMM at its default config)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--swap", action="store_true", help="time the 4-bit swap-AB kernel (rows default 1 4 16)")
    ap.add_argument("--group", type=int, default=128, help="--swap: the group size of the int4 weights")
    ap.add_argument("--budget-s", type=float, default=100.0, help="--swap: past this, shapes get the default only")
    ap.add_argument("--kperm", action="store_true",
                    help="4-bit: also time wna16_linear (the engine's dispatch) on the plain and the steps-permuted "
                         "layout (PAGEDLLM_WNA16_KPERM: kpairs without x's gather), each checked first")
    args = ap.parse_args()
    if args.swap:
        if args.rows == ROWS:
            args.rows = [1, 4, 16]
        from wna16_swap_bench import swap_main

        swap_main(args)
        return
    dev = "cuda"
    if not args.skip_check:
        correctness(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    results: dict[str, dict] = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        qs = [quantize_wna16_torch(w, args.bits, 128, True) for w in ws]
        nbytes = qs[0][0].numel() * 4 + qs[0][1].numel() * 2
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = wna16_linear_torch(x, *qs[0], args.bits)
            row: dict = {"bf16": graph_time(lambda: [torch.nn.functional.linear(x, w) for w in ws])}
            if m >= 64:
                row["dense"] = graph_time(lambda: [x @ dequantize_wna16_triton(q, s, z, args.bits, x.dtype)
                                                   for q, s, z in qs])
            cfgs = [engine_config(m, n, k, args.bits)] + ([] if args.no_sweep or args.kpairs_only
                                                          else sweep(m, k, args.bits))
            timed = time_configs(
                cfgs, lambda c, x=x, qs=qs: wna16_gemm_triton(x, *qs[0], args.bits, config=c),
                lambda c, x=x, qs=qs: [wna16_gemm_triton(x, q, s, z, args.bits, config=c) for q, s, z in qs], ref,
                f"{name} m={m}")
            if timed and timed[0][1] == cfgs[0]:
                row["default"], row["default_cfg"] = timed[0]
            row["best"], row["best_cfg"] = min(timed, key=lambda tc: tc[0], default=(float("nan"), cfgs[0]))
            if args.bits == 4 and m > 1:  # the K-packed layout's tensor-core GEMM, its default first
                kcfgs = [kpairs_default(m, n, k, 128)] + ([] if args.no_sweep else kpairs_sweep(m, k))
                if time_default_and_best(
                    row, "kpairs", kcfgs, lambda c, x=x, qs=qs: wna16_kpairs_gemm(x, *qs[0], config=c),
                    lambda c, x=x, qs=qs: [wna16_kpairs_gemm(x, q, s, z, config=c) for q, s, z in qs], ref,
                    f"kpairs {name} m={m}"):
                    print(f"{name:8s} m={m:4d} kpairs default {row['kpairs']:7.1f} best {row['kpairs_best']:7.1f} "
                          f"{fields(row['kpairs_best_cfg'])}  bf16/kpairs {row['bf16'] / row['kpairs_best']:.2f}x",
                          flush=True)
            if args.kperm and args.bits == 4:  # the engine's product on each layout, gather included
                qks = [(kperm_pack(q), s, z) for q, s, z in qs]
                check(wna16_linear(x, *qks[0], 4, kperm=True), ref, f"kperm {name} m={m}")
                row["linear"] = graph_time(lambda: [wna16_linear(x, q, s, z, 4) for q, s, z in qs])
                row["linear_kperm"] = graph_time(lambda: [wna16_linear(x, q, s, z, 4, kperm=True) for q, s, z in qks])
                print(f"{name:8s} m={m:4d} wna16_linear us/layer: plain {row['linear']:7.1f}  steps-permuted "
                      f"{row['linear_kperm']:7.1f}  ({row['linear'] / row['linear_kperm']:.3f}x)", flush=True)
                qks = []
            gbs = nbytes / (row["best"] * 1e-6) / 1e9
            dense = f"  dense {row['dense']:7.1f}" if "dense" in row else ""
            print(f"{name:8s} m={m:4d} us/layer: bf16 {row['bf16']:7.1f}{dense}  default {row.get('default', 0):7.1f}  "
                  f"best {row['best']:7.1f} {row['best_cfg']} ({gbs:5.0f} GB/s of weights)  "
                  f"bf16/best {row['bf16'] / row['best']:.2f}x", flush=True)
            results[f"{name}:{m}"] = row
        ws = qs = []  # the layers freed before the next shape
        torch.cuda.empty_cache()
    print(f"\nsum over the four projections x {LAYERS} layers, ms per step (CUDA graph), int{args.bits} g128:")
    print(f"{'rows':>5} {'bf16':>8} {'default':>8} {'best':>8} {'bf16/best':>10} {'dense':>8} {'kpairs':>8} "
          f"{'kp best':>8} {'bf16/kp':>8}")
    for m in args.rows:
        tot = {key: LAYERS * sum(results[f"{nm}:{m}"].get(key, float("nan")) for nm in SHAPES) / 1000
               for key in ("bf16", "default", "best", "dense", "kpairs", "kpairs_best")}
        print(f"{m:5d} {tot['bf16']:8.3f} {tot['default']:8.3f} {tot['best']:8.3f} {tot['bf16'] / tot['best']:9.2f}x "
              f"{tot['dense']:8.3f} {tot['kpairs']:8.3f} {tot['kpairs_best']:8.3f} "
              f"{tot['bf16'] / tot['kpairs_best']:7.2f}x")
    if args.kperm and args.bits == 4:
        print(f"\nwna16_linear, ms per step over the four projections x {LAYERS} layers: plain / steps-permuted")
        for m in args.rows:
            a, b = (LAYERS * sum(results[f"{nm}:{m}"][key] for nm in SHAPES) / 1000
                    for key in ("linear", "linear_kperm"))
            print(f"{m:5d} {a:8.3f} {b:8.3f} {a / b:7.3f}x")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"wna16_bench_int{args.bits}.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
    if WRONG:
        print(f"\n{len(WRONG)} wrong product(s):", *WRONG, sep="\n  ")
        sys.exit(1)
