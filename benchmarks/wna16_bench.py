"""Integer weight-only linears (W4A16, W8A16) on CUDA, timed like fp8_bench.py: inside a CUDA
graph, 32 layers with distinct weights (none served from L2), Llama-3.1-8B's four projection
shapes, int4 symmetric in groups of 128 (the dummy weights' format). Compared per row count:
bf16 `F.linear`, the Triton kernels (default config, then the sweep), and the prefill path
(dequantize + cuBLAS). Every config is checked against the torch reference before it is
timed; a config that fails to compile is reported and skipped. Prints per shape and row count
the best config and the GB/s of weights it reaches, then the sum over the four shapes and 32
layers; with $OUT set, writes $OUT/wna16_bench.json.

    PYTHONPATH=. python benchmarks/wna16_bench.py [--rows 1 16 64 256] [--no-sweep]

--swap times the 4-bit swap-AB tensor-core kernel (kernels/wna16_swap_triton.py, N-major layout)
instead, at 1 / 4 / 16 rows by default, beside bf16 cuBLAS and the K-packed int4 kernels' default
(the GEMV to 4 rows, the dot GEMM above): a correctness pass first (groups 32 / 128 / channel,
symmetric and asymmetric, bf16 and fp16, 1-47 rows, the PTX dequantization equal to the plain one
bit for bit), then per shape a small sweep of SwapConfigs, each checked against the reference
before it is timed; prints a table, the best config per shape and row count, and the sums over
32 layers. About 1-2 minutes on an H200 (--budget-s caps the sweep). From 48 rows the "int4 old"
column is what the engine runs there (the weight dequantized, then cuBLAS) and the sweep takes the
GEMM's tiles (64 / 128 activation rows a program, PAGEDLLM_WNA16_GEMM=swap):

    PYTHONPATH=. python benchmarks/wna16_bench.py --swap [--rows 1 4 16] [--group 128] [--budget-s 90]
    PYTHONPATH=. python benchmarks/wna16_bench.py --swap --rows 64 256 --skip-check   # the W4A16 GEMM

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

from pagedllm.kernels.wna16 import (  # noqa: E402
    DENSE_MIN_ROWS,
    kperm_pack,
    quantize_wna16_torch,
    wna16_linear,
    wna16_linear_torch,
)
from pagedllm.kernels.wna16_kpairs_triton import default_config as kpairs_default  # noqa: E402
from pagedllm.kernels.wna16_kpairs_triton import wna16_kpairs_gemm  # noqa: E402
from pagedllm.kernels.wna16_triton import default_config, dequantize_wna16_triton, wna16_gemm_triton  # noqa: E402
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


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    if err > 0.02:
        raise AssertionError(f"{what}: max error {err:.4f} of the reference's max")
    return err


WRONG: list[str] = []  # the configs whose product failed its check: reported, not timed, and the exit status 1


def time_configs(cfgs: list, one, many, ref: torch.Tensor, label: str) -> list[tuple[float, object]]:
    """(us, config) of each config that compiles and is right, in order: `one(cfg)` checked against
    `ref` first, then `many(cfg)` (every layer) timed in a CUDA graph. A config the compiler refuses
    (shared memory) is skipped with a line; a wrong one too, with a WRONG line, and kept in WRONG
    (the sweep goes on, and the run exits 1 at its end)."""
    timed = []
    for cfg in cfgs:
        try:
            check(one(cfg), ref, f"{label} {cfg}")
            t = graph_time(lambda: many(cfg))
        except AssertionError as e:
            print(f"  WRONG {e}", flush=True)
            WRONG.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        print(f"  {label} {cfg}: {t:.1f} us", flush=True)
        timed.append((t, cfg))
    return timed


def time_default_and_best(row: dict, key: str, cfgs: list, one, many, ref: torch.Tensor, label: str) -> bool:
    """time_configs over cfgs, the default first (duplicates dropped): row[key] the default's us
    (NaN if it did not run), row[key + "_best"] / row[key + "_best_cfg"] the fastest. False when no
    config ran."""
    cfgs = list(dict.fromkeys(cfgs))
    timed = time_configs(cfgs, one, many, ref, label)
    if not timed:
        return False
    row[key] = timed[0][0] if timed[0][1] == cfgs[0] else float("nan")
    row[f"{key}_best"], row[f"{key}_best_cfg"] = min(timed, key=lambda tc: tc[0])
    return True


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


def swap_sweep(n: int, k: int, group_k: int, m: int = 1) -> list:
    """SwapConfigs around the default: 64-wide weight tiles with K steps of 128 / 256, 128-wide
    ones (8 warps) with 128, one 32-wide (mma.sync), split-K 1-8 while the programs stay under
    1024 and each split keeps two K steps. More than 16 rows (the GEMM; activation tiles up to
    twice the rows): 128-wide weight tiles against 64 (4 warps) or 128 (8 warps) activation rows, K
    steps of 64 / 128, and 128- or 64-wide ones against 256 rows (8 warps, K steps of 64: sm_90 211 /
    126 registers, no spills), split-K 1-4; and the pairs kernel (SwapConfig.pairs) at K steps of
    128 and 64 / 128 rows. At 256 rows a program each dequantized weight element feeds twice the
    MMA work of 128."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    if m > 16:
        gemm = []
        for bn, bm, warps, bks in ((128, 64, 4, (64, 128)), (128, 128, 8, (64, 128)), (128, 256, 8, (64,)),
                                   (64, 256, 8, (64,))):
            if bm > 2 * m:
                continue
            for bk in bks:
                for split in (1, 2, 4):
                    if k >= 2 * bk * split and (group_k == 0 or group_k % bk == 0 or bk % group_k == 0):
                        gemm.append(SwapConfig(bn, bk, split, warps, 3, block_m=bm))
                        if bk == 128 and bm <= 128:  # the pairs kernel: its operand built in registers
                            gemm.append(SwapConfig(bn, bk, split, warps, 3, block_m=bm, pairs=True))
        return gemm
    cfgs = []
    for bn, warps, bks in ((64, 4, (128, 256)), (128, 8, (128,))):
        for bk in bks:
            for split in (1, 2, 4, 8):
                if -(-n // bn) * split > 1024 or k < 2 * bk * split:
                    continue
                cfgs.append(SwapConfig(bn, bk, split, warps, 4 if split == 1 and bk == 128 else 3))
    cfgs.append(SwapConfig(32, 128, 1, 4, 4))
    return cfgs


def gemvn_sweep(n: int, k: int, group_k: int) -> list[tuple[int, int, int, int]]:
    """gemvn configs (BLOCK_N, BLOCK_KW, split_k, num_warps) around its default: 64-256 rows a tile
    of its words a row (at most one group), 4 or 8 warps, split-K 1-16 while each split keeps two
    tiles. The default keeps about one 4-warp program an SM on the 4,096-row projections (W2 4.66
    against gemvp's 3.24 ms/token on the H100): this asks whether more warps or programs in flight
    are what it lacks."""
    bkw = 16 if group_k == 0 else max(1, min(16, group_k // 8))
    return [(bn, bkw, split, warps) for bn in (64, 128, 256) for warps in (4, 8) for split in (1, 4, 8, 16)
            if k // 8 >= 2 * bkw * split]


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
    # one dot an iteration, in the chained tiles of 8 warps
    flat = [dataclasses.replace(c, dots="flat") for c in one if c.num_warps == 8]
    # two accumulators in the chained tiles of up to 128 rows
    accs2 = [dataclasses.replace(c, dots="accs2") for c in one if c.block_m <= 128]
    return one + narrow + accs + flat + accs2


def _fields(cfg) -> tuple:
    return (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.block_m) + (
        ("pairs",) if cfg.pairs else ()) + ((cfg.dots,) if cfg.dots != "chain" else ())


def swap_correctness(dev: str) -> None:
    from pagedllm.kernels.swap_gemm_triton import SwapConfig
    from pagedllm.kernels.wna16 import to_int4_nk, wna16_int4_nk_linear, wna16_int4_nk_linear_torch
    from pagedllm.kernels.wna16_swap_triton import wna16_swap_gemm

    g = torch.Generator(device=dev).manual_seed(2)
    worst, cases = 0.0, 0
    bf16, fp16 = torch.bfloat16, torch.float16
    for gk, sym, dtype, (m, n, k) in ((128, True, bf16, (1, 4096, 4096)), (32, False, fp16, (5, 1000, 2048)),
                                      (None, False, bf16, (16, 1024, 14336)), (128, False, bf16, (40, 512, 1024)),
                                      (64, True, fp16, (3, 768, 4096))):  # fmt: skip
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        qn, sn, zn = to_int4_nk(*quantize_wna16_torch(w, 4, gk, sym, dtype))
        x = torch.randn(m, k, device=dev, generator=g).to(dtype)
        bias = torch.randn(n, device=dev, generator=g).to(dtype)
        ref = wna16_int4_nk_linear_torch(x, qn, sn, zn, bias)
        what = f"swap g={gk} sym={sym} {m}x{n}x{k} {dtype}"
        worst = max(worst, check(wna16_int4_nk_linear(x, qn, sn, zn, bias), ref, what))
        cfg = SwapConfig(64, 128, 2, 4, 3)
        a = wna16_swap_gemm(x[:16], qn, sn, zn, bias, cfg, asm=True)
        if not torch.equal(a, wna16_swap_gemm(x[:16], qn, sn, zn, bias, cfg, asm=False)):
            raise AssertionError(f"{what}: the PTX dequantization differs from the plain one")
        cases += 1
    print(f"swap correctness: {cases} cases (groups 32/64/128/channel, sym/asym, bf16/fp16, M 1..40), worst max "
          f"error {worst:.4f} of the reference's max; PTX == plain dequantization bit for bit", flush=True)


def swap_main(args) -> None:
    import time

    from pagedllm.kernels.wna16 import to_int4_nk, wna16_int4_nk_linear_torch
    from pagedllm.kernels.wna16_swap_triton import default_config as swap_default
    from pagedllm.kernels.wna16_swap_triton import wna16_swap_gemm

    dev = "cuda"
    t0 = time.time()
    if not args.skip_check:
        swap_correctness(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    gk = args.group
    results: dict[str, dict] = {}
    print(f"{'shape':8s} {'rows':>4s} {'bf16':>7s} {'int4 old':>8s} {'swap dflt':>9s} {'swap best':>9s} "
          f"{'GB/s':>5s} {'bf16/best':>9s} {'old/best':>8s}  best config (us per layer, CUDA graph of {LAYERS})")
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        olds = [quantize_wna16_torch(w, 4, gk, True) for w in ws]
        news = [to_int4_nk(*q) for q in olds]
        top: list = []
        nbytes = news[0][0].numel() * 4 + news[0][1].numel() * 2
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = wna16_int4_nk_linear_torch(x, *news[0])
            row: dict = {"bf16": graph_time(lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws])}
            if m >= DENSE_MIN_ROWS:  # PAGEDLLM_WNA16_GEMM=dense there: the weight dequantized, then cuBLAS
                row["old"] = graph_time(lambda x=x, qs=olds: [
                    x @ dequantize_wna16_triton(q, s, z, 4, x.dtype) for q, s, z in qs])
            else:
                old_cfg = default_config(m, n, k, gk, 4)
                row["old"] = graph_time(
                    lambda x=x, c=old_cfg, qs=olds: [wna16_gemm_triton(x, q, s, z, 4, config=c) for q, s, z in qs]
                )
            dflt = swap_default(m, n, k, gk)
            over = time.time() - t0 > args.budget_s
            sweep_cfgs = [] if args.no_sweep or over else swap_sweep(n, k, gk, m)
            if m not in (1, 16) and m <= 16 and top:  # rows between: the three best at 1 row
                sweep_cfgs = top[:3]
            cfgs = [dflt] + [c for c in sweep_cfgs if c != dflt]
            timed = time_configs(
                cfgs, lambda c, x=x, qs=news: wna16_swap_gemm(x, *qs[0], config=c),
                lambda c, x=x, qs=news: [wna16_swap_gemm(x, q, s, z, config=c) for q, s, z in qs], ref,
                f"{name} m={m}")
            row["swap_default"] = timed[0][0] if timed and timed[0][1] == dflt else float("nan")
            if m == 1:  # the N-major layout's one-row GEMV (what the dispatcher runs there), its default first
                from pagedllm.kernels.wna16_gemvn_triton import gemvn_config, wna16_gemvn

                gcfgs = [gemvn_config(n, k, gk)] + ([] if args.no_sweep or over else gemvn_sweep(n, k, gk))
                if time_default_and_best(
                    row, "gemvn", gcfgs, lambda c, x=x, qs=news: wna16_gemvn(x, *qs[0], config=c),
                    lambda c, x=x, qs=news: [wna16_gemvn(x, q, s, z, config=c) for q, s, z in qs], ref,
                    f"gemvn {name}"):
                    gbs = nbytes / (row["gemvn_best"] * 1e-6) / 1e9
                    print(f"{name:8s} {m:4d} gemvn default {row['gemvn']:7.1f} us, best {row['gemvn_best']:7.1f} "
                          f"({gbs:5.0f} GB/s) {row['gemvn_best_cfg']}", flush=True)
            best = min(timed, key=lambda tc: tc[0], default=(float("nan"), dflt))
            if m == 1:
                top = [c for _, c in sorted(timed, key=lambda tc: tc[0])]
            row["swap_best"], row["swap_best_cfg"] = best
            gbs = nbytes / (best[0] * 1e-6) / 1e9
            print(f"{name:8s} {m:4d} {row['bf16']:7.1f} {row['old']:8.1f} {row['swap_default']:9.1f} {best[0]:9.1f} "
                  f"{gbs:5.0f} {row['bf16'] / best[0]:8.2f}x {row['old'] / best[0]:7.2f}x  {_fields(best[1])}"
                  f"{'  (sweep skipped: budget)' if over else ''}", flush=True)
            results[f"{name}:{m}"] = row
        ws = olds = news = []
        torch.cuda.empty_cache()
    print(f"\nsum over the four projections x {LAYERS} layers, ms per step, int4 g{gk} symmetric:")
    print(f"{'rows':>5} {'bf16':>8} {'int4 old':>8} {'swap dflt':>9} {'swap best':>9} {'bf16/best':>9}")
    for m in args.rows:
        tot = {key: LAYERS * sum(results[f"{nm}:{m}"][key] for nm in SHAPES) / 1000
               for key in ("bf16", "old", "swap_default", "swap_best")}
        print(f"{m:5d} {tot['bf16']:8.3f} {tot['old']:8.3f} {tot['swap_default']:9.3f} {tot['swap_best']:9.3f} "
              f"{tot['bf16'] / tot['swap_best']:8.2f}x")
    print("\nbest SwapConfig per shape (block_n, block_k, split_k, num_warps, num_stages, block_m):")
    for name, (n, k) in SHAPES.items():
        per_m = {m: results[f"{name}:{m}"]["swap_best_cfg"] for m in args.rows}
        print(f"  ({n}, {k}): " + ", ".join(f"{m} rows {_fields(c)}" for m, c in per_m.items()))
    print(f"[swap bench: {time.time() - t0:.0f} s]")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "wna16_swap_bench.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)


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
                          f"{_fields(row['kpairs_best_cfg'])}  bf16/kpairs {row['bf16'] / row['kpairs_best']:.2f}x",
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
