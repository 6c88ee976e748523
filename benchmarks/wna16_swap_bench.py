"""The 4-bit swap-AB tensor-core kernel (kernels/wna16_swap_triton.py, N-major layout), timed by
`wna16_bench.py --swap` (its arguments there; the checks and timing shared in wna16_timing.py).

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
"""

from __future__ import annotations

import json
import os

import torch
from fp8_bench import LAYERS, SHAPES, graph_time
from wna16_timing import check, fields, time_configs, time_default_and_best

from pagedllm.kernels.wna16 import DENSE_MIN_ROWS, quantize_wna16_torch
from pagedllm.kernels.wna16_triton import default_config, dequantize_wna16_triton, wna16_gemm_triton


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
                  f"{gbs:5.0f} {row['bf16'] / best[0]:8.2f}x {row['old'] / best[0]:7.2f}x  {fields(best[1])}"
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
        print(f"  ({n}, {k}): " + ", ".join(f"{m} rows {fields(c)}" for m, c in per_m.items()))
    print(f"[swap bench: {time.time() - t0:.0f} s]")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "wna16_swap_bench.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
