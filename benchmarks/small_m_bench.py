"""Dense bf16 linears of 1-16 rows on CUDA: cuBLAS (`F.linear`; the MoE router's
`torch.mm(..., out_dtype=float32)`) against the swap-AB kernel (pagedllm/kernels/small_m.py) over a
pruned sweep of its configs, for Qwen3-30B-A3B's qkv / o / router, Llama-3.1-8B's four projections
and Qwen3-0.6B's four (hidden 1024).

Timed as decode steps run them: a CUDA graph of many layers with distinct weights (>= 256 MB of
them, so no weight comes from L2; at least 2 layers), replayed; us per layer and the weight bytes
read per second. Each config is checked against the float32 reference before it is timed.

The sweep, per shape (compiles dominate the run, so it is staged):
  1. at 1 and 16 rows: BLOCK_N 32/64/128 x BLOCK_K 64/128/256 x split-K 1/2/4/8 (4 warps, 3 stages),
     keeping tiles of 32 x 128 to 128 x 128, two K steps a split, and a sensible program count;
  2. at 1 and 16 rows: the best of 1 with 4/8 warps x 2-4 stages;
  3. at every row count: cuBLAS, the heuristic default, and the three best of 2 at 1 and 16 rows.
Past --budget-s seconds, the remaining shapes get --quick's sweep. Prints a table, the best
config per (shape, rows), and small_m.CONFIGS entries (None where cuBLAS stays ahead by less than
3%); --output-json writes everything. Without CUDA: a smoke test of the same code on tiny
shapes under Triton's interpreter (float16; no timings).

    python3 benchmarks/small_m_bench.py [--quick] [--output-json PATH]
    python3 benchmarks/small_m_bench.py --last-reduce [--output-json PATH]   # about 1 minute

--last-reduce times only the split-K shapes of small_m.CONFIGS (Qwen3-30B-A3B o and router,
Llama-3.1-8B o, Qwen3-0.6B o and down) at 1, 4 and 16 rows: cuBLAS, the table's config with its
reduce kernel, and the same config reduced by the last split (SwapConfig.reduce "last",
the engine's default; PAGEDLLM_SWAP_LAST_REDUCE=0 keeps the kernel); the reduce kernel's output and the last split's
must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (torch only: triton is imported later, after TRITON_INTERPRET is set)

# name -> (N, K); the router writes float32
SHAPES = {
    "qwen3moe_qkv": (5120, 2048),
    "qwen3moe_o": (2048, 4096),
    "qwen3moe_router": (128, 2048),
    "llama8b_qkv": (6144, 4096),
    "llama8b_o": (4096, 4096),
    "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
    "qwen06_qkv": (4096, 1024),
    "qwen06_o": (1024, 2048),
    "qwen06_gate_up": (6144, 1024),
    "qwen06_down": (1024, 3072),
}
QUICK_SHAPES = ["qwen3moe_qkv", "qwen3moe_o", "qwen3moe_router", "llama8b_o", "llama8b_gate_up"]
# the table's split-K shapes (--last-reduce)
SPLIT_K_SHAPES = ["qwen3moe_o", "qwen3moe_router", "llama8b_o", "qwen06_o", "qwen06_down"]
ROWS = [1, 2, 4, 8, 16]
WEIGHT_BYTES = 256 << 20  # per shape: enough layers to pass H200's 50 MB L2 several times
MAX_LAYERS = 512
MAX_SHARED = 200 << 10  # a config's pipelined tiles must fit the SM's shared memory (228 KB)


def out_dtype_of(name: str) -> torch.dtype | None:
    return torch.float32 if name.endswith("router") else None


def cublas(x, w, out_dtype):
    if out_dtype is None:
        return torch.nn.functional.linear(x, w)
    return torch.mm(x, w.t(), out_dtype=out_dtype)  # the router's product (model/layers/fused_moe.py)


def stage1(n: int, k: int, quick: bool) -> list:
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    cfgs = []
    for bn in (64, 128) if quick else (32, 64, 128):
        for bk in (128,) if quick else (64, 128, 256):
            for split in (1, 2, 4, 8):
                programs = -(-n // bn) * split
                if not 32 * 128 <= bn * bk <= 128 * 128 or k < 2 * bk * split:
                    continue
                if split > 1 and programs > 1200:  # enough programs without splitting further
                    continue
                cfgs.append(SwapConfig(bn, bk, split, 4, 3))
    return cfgs


def shared_bytes(cfg) -> int:
    return cfg.num_stages * (cfg.block_n + 16) * cfg.block_k * 2


def stage2(best: list) -> list:
    from dataclasses import replace

    cfgs = [replace(c, num_warps=w, num_stages=s) for c in best[:1] for w in (4, 8) for s in (2, 3, 4)]
    return [c for c in cfgs if shared_bytes(c) <= MAX_SHARED]


def fields(cfg) -> tuple:
    f = (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages)
    return f + (cfg.reduce,) if cfg.reduce != "kernel" else f


class ShapeRun:
    """One weight shape: its layers, inputs per row count, and every (rows, config) timed once."""

    def __init__(self, name: str, n: int, k: int, device: str, layers: int, timed: bool):
        self.name, self.n, self.k, self.timed = name, n, k, timed
        self.out_dtype = out_dtype_of(name)
        dtype = torch.bfloat16 if timed else torch.float16  # the interpreter's bf16 dot is not usable here
        g = torch.Generator(device=device).manual_seed(0)
        self.ws = [torch.randn(n, k, device=device, generator=g, dtype=dtype) * 0.02 for _ in range(layers)]
        self.xs = {m: torch.randn(m, k, device=device, generator=g, dtype=dtype) for m in ROWS}
        self.results: dict[int, dict] = {m: {} for m in ROWS}  # rows -> {fields or "cublas": us}

    def time(self, m: int, cfg) -> float | None:
        """us per layer of the config (None: it failed its check or did not launch)."""
        from pagedllm.kernels.small_m import small_m_linear, small_m_linear_torch

        key = "cublas" if cfg is None else fields(cfg)
        if key in self.results[m]:
            return self.results[m][key]
        x, ws, od = self.xs[m], self.ws, self.out_dtype
        if cfg is not None:
            try:
                out = small_m_linear(x, ws[0], None, od, cfg)
            except Exception as e:  # out of shared memory or registers for this tile
                print(f"  {self.name} m={m} {fields(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                self.results[m][key] = None
                return None
            ref = small_m_linear_torch(x, ws[0], None, od)
            err = (out.float() - ref.float()).abs().max().item()
            if err > 0.02 * ref.float().abs().max().item() + 1e-2:
                raise AssertionError(f"{self.name} m={m} {fields(cfg)}: max error {err}")
        if not self.timed:
            t = 0.0
        elif cfg is None:
            t = common.graph_time(lambda: [cublas(x, w, od) for w in ws], len(ws), reps=10, rounds=3)
        else:
            t = common.graph_time(lambda: [small_m_linear(x, w, None, od, cfg) for w in ws], len(ws), reps=10, rounds=3)
        self.results[m][key] = t
        return t

    def ranked(self, m: int, cfgs) -> list:
        timed = [(self.time(m, c), c) for c in cfgs]
        return [c for t, c in sorted((tc for tc in timed if tc[0] is not None), key=lambda tc: tc[0])]


def run_shape(run: ShapeRun, quick: bool, rows: list[int]) -> dict:
    from pagedllm.kernels.small_m import heuristic_config

    top: list = []
    for m in dict.fromkeys((rows[0], rows[-1])):
        best = run.ranked(m, stage1(run.n, run.k, quick))
        if not quick:
            best = run.ranked(m, best[:2] + stage2(best))
        top += [c for c in best[:3] if c not in top]
    summary = {}
    for m in rows:
        default = heuristic_config(m, run.n, run.k)
        run.ranked(m, [default] + top)
        base = run.time(m, None)
        scored = {key: t for key, t in run.results[m].items() if key != "cublas" and t is not None}
        best_key = min(scored, key=scored.get)
        summary[m] = {
            "cublas_us": base,
            "default": fields(default),
            "default_us": run.results[m][fields(default)],
            "best": best_key,
            "best_us": scored[best_key],
            "timed": [[list(key), t] for key, t in scored.items()],
        }
    return summary


def report(name: str, n: int, k: int, summary: dict) -> list:
    """Prints one shape's rows; returns its small_m.CONFIGS entry."""
    gb = n * k * 2 / 1e9
    entry = []
    for m, r in summary.items():

        def tbs(us):
            return gb / (us * 1e-6) / 1e3 if us else 0.0

        print(
            f"{name:16s} m={m:2d}  cuBLAS {r['cublas_us']:7.2f} us ({tbs(r['cublas_us']):4.2f} TB/s)  "
            f"default {r['default_us']:7.2f} ({tbs(r['default_us']):4.2f})  best {r['best_us']:7.2f} "
            f"({tbs(r['best_us']):4.2f}) {r['best']}  x{r['cublas_us'] / max(r['best_us'], 1e-9):4.2f}",
            flush=True,
        )
        choice = r["best"] if r["best_us"] < 0.97 * r["cublas_us"] else None
        if entry and entry[-1][1] == choice:
            entry[-1] = (m, choice)
        else:
            entry.append((m, choice))
    return entry


def last_reduce_ab(timed: bool) -> dict:
    """--last-reduce: per split-K shape and row count, cuBLAS / the table's config with its reduce
    kernel / the same reduced by the last split (us per layer); the two kernels' outputs must be
    bitwise equal."""
    from dataclasses import replace

    from pagedllm.kernels import small_m
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    sizes = {name: SHAPES[name] for name in SPLIT_K_SHAPES}
    if not timed:
        sizes = {"tiny_o": (96, 1024), "tiny_router": (24, 512)}
    results = {}
    print(f"{'shape':16s} rows   cuBLAS   kernel     last  (us per layer; last/kernel)", flush=True)
    for name, (n, k) in sizes.items():
        fields_ = small_m.CONFIGS[(n, k)][-1][1] if timed else (32, 128, 4, 4, 3)
        cfg = SwapConfig(*fields_)
        assert cfg.split_k > 1, (name, cfg)
        last = replace(cfg, reduce="last")
        layers = max(2, min(MAX_LAYERS, math.ceil(WEIGHT_BYTES / (n * k * 2)))) if timed else 1
        run = ShapeRun(name, n, k, "cuda" if timed else "cpu", layers, timed)
        for m in (1, 4, 16):
            x, w, od = run.xs[m], run.ws[0], run.out_dtype
            a = small_m.small_m_linear(x, w, None, od, cfg)
            b = small_m.small_m_linear(x, w, None, od, last)
            assert torch.equal(a, b), f"{name} m={m}: the last split's output differs from the reduce kernel's"
            t_cublas, t_kernel, t_last = run.time(m, None), run.time(m, cfg), run.time(m, last)
            results[f"{name}:{m}"] = {"config": fields(cfg), "cublas_us": t_cublas, "kernel_us": t_kernel,
                                      "last_us": t_last}
            ratio = t_last / t_kernel if t_kernel else float("nan")
            print(f"{name:16s} {m:4d} {t_cublas:8.2f} {t_kernel:8.2f} {t_last:8.2f}  x{ratio:4.2f}  {fields(cfg)}",
                  flush=True)  # fmt: skip
        del run
        if timed:
            torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="five shapes, 1/4/16 rows, a smaller stage-1 sweep, no stage 2"
    )
    ap.add_argument("--shapes", nargs="*", choices=list(SHAPES))
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--budget-s", type=float, default=120.0, help="after this, the remaining shapes sweep as --quick")
    ap.add_argument("--last-reduce", action="store_true",
                    help="only the split-K shapes: reduce kernel against the last split's reduce")
    args = ap.parse_args()
    timed = torch.cuda.is_available()
    if not timed:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (pagedllm imports it lazily)
    if args.last_reduce:
        start = time.perf_counter()
        results = last_reduce_ab(timed)
        if args.output_json:
            device = torch.cuda.get_device_name() if timed else "cpu (interpreter)"
            with open(args.output_json, "w") as fh:
                json.dump({"device": device, "last_reduce": results}, fh, indent=1, default=str)
        print(f"done in {time.perf_counter() - start:.0f} s")
        return
    shapes = args.shapes or (QUICK_SHAPES if args.quick else list(SHAPES))
    rows = [1, 4, 16] if args.quick or not timed else ROWS
    sizes = {name: SHAPES[name] for name in shapes}
    if not timed:
        print("no CUDA: a smoke test under Triton's interpreter on tiny shapes (float16), no timings")
        sizes = {"tiny_qkv": (96, 1024), "tiny_router": (24, 512)}
    start = time.perf_counter()
    results, table = {}, {}
    for name, (n, k) in sizes.items():
        layers = max(2, min(MAX_LAYERS, math.ceil(WEIGHT_BYTES / (n * k * 2)))) if timed else 1
        run = ShapeRun(name, n, k, "cuda" if timed else "cpu", layers, timed)
        quick = args.quick or time.perf_counter() - start > args.budget_s
        summary = run_shape(run, quick, rows)
        results[name] = {"n": n, "k": k, "layers": layers, "quick_sweep": quick, "rows": summary}
        table[(n, k)] = report(name, n, k, summary)
        del run
        if timed:
            torch.cuda.empty_cache()
        print(f"  ({time.perf_counter() - start:.0f} s so far)", flush=True)
    print("\nsmall_m.CONFIGS entries (max rows, config or None = cuBLAS), from this run:")
    for (n, k), entry in table.items():
        print(f"    ({n}, {k}): {entry},")
    if args.output_json:
        payload = {
            "device": torch.cuda.get_device_name() if timed else "cpu (interpreter)",
            "seconds": time.perf_counter() - start,
            "shapes": results,
            "configs": {f"{n}x{k}": e for (n, k), e in table.items()},
        }
        with open(args.output_json, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
