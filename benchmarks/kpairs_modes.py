"""The kpairs GEMM's tiles (K steps of 128) in several modes, us a call at Llama-3.1-8B's four
projections (int4, groups of 128, the steps-permuted layout), in CUDA graphs of 20 calls, medians of
5, each checked against the reference first (" !" where not close). A mode is STAGES[:DOTS][@TILE]:
SwapConfig.dots (chain unless given) and TILE = BLOCK_NxBLOCK_MxWARPS[xSPLIT] (weight rows, activation
rows, warps, split-K; unless given 128-row tiles of 128 weight rows, 8 warps, the default's split where
it takes 128-row tiles, else 1). The default config is timed first. The twenty-fifth session's run: 3,
4 and 5 stages time the same (what a K step costs is not the loads' latency); the twenty-sixth's:
accs2 beats chain at 128-row tiles. 64x256x4 (one warpgroup an SM, each weight tile dequantized once
for 256 rows, 96 programs at q/k/v) compiles for sm_90 at 235 registers, 213 KB of shared memory at 3
stages (139 KB at 2), no spills: not yet timed.
    python benchmarks/kpairs_modes.py [--rows 96 192 256] [--modes 3 4 3:accs2 3@64x256x4 2@64x256x4]"""

from __future__ import annotations

import argparse
import statistics

import torch

from pagedllm.kernels.swap_gemm_triton import SwapConfig
from pagedllm.kernels.wna16 import kperm_pack, wna16_linear_torch
from pagedllm.kernels.wna16_kpairs_triton import default_config, wna16_kpairs_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time(fn, reps: int = 5, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[96, 192, 256])
    ap.add_argument("--modes", nargs="*", default=["3", "3:accs2", "3@64x256x4", "2@64x256x4"])
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'proj':8} {'rows':>5} {'default':>18} " + " ".join(f"{mode:>14}" for mode in args.modes))
    for name, (n, k) in SHAPES.items():
        qw = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, device="cuda", dtype=torch.int32)
        s = (torch.rand(k // 128, n, generator=g, device="cuda") * 0.01).to(torch.bfloat16)
        qp = kperm_pack(qw)
        for m in args.rows:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            ref = wna16_linear_torch(x, qw, s, None, 4)
            d = default_config(m, n, k, 128)
            row = [f"{name:8} {m:5} {_time(lambda: wna16_kpairs_gemm(x, qp, s, None, kperm=True)):8.1f} "
                   f"({d.block_m}x{d.split_k}s{d.num_stages})"]
            for mode in args.modes:
                mode, _, tile = mode.partition("@")
                stages, _, dots = mode.partition(":")
                block_n, block_m, warps, *split = (int(t) for t in tile.split("x")) if tile else (128, 128, 8)
                split_k = split[0] if split else (d.split_k if d.block_m == 128 and not tile else 1)
                cfg = SwapConfig(block_n, 128, split_k, warps, int(stages), block_m=block_m, pairs=True,
                                 dots=dots or "chain")
                out = wna16_kpairs_gemm(x, qp, s, None, config=cfg, kperm=True)
                ok = torch.allclose(out.float(), ref.float(), atol=0.05, rtol=0.02)
                try:
                    t = _time(lambda cfg=cfg: wna16_kpairs_gemm(x, qp, s, None, config=cfg, kperm=True))
                    row.append(f"{t:12.1f}{'' if ok else ' !'}")
                except Exception as e:  # (too much shared memory at some stages)
                    row.append(f"{type(e).__name__[:12]:>14}")
            print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
