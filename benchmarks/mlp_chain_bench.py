"""Llama-3.1-8B's MLP at one row with 4-bit weights (int4, groups of 128, symmetric, the
steps-permuted layout: W2 gptq's dummy weights), 32 layers chained (each layer's output the next
one's input) in a CUDA graph, distinct weights a layer (none from L2), us a layer:

    engine     wna16_linear(gate_up) -> silu_and_mul -> wna16_linear(down): the engine's three
               kernels (gemvp, PDL where the engine takes it)
    staged     wna16_mlp_chain a stage a launch (two kernels, no barrier)
    chain ...  wna16_mlp_chain's persistent kernel (kernels/wna16_chain_triton.py) at the configs
               given (BLOCK_N_GU, BLOCK_KW_GU, BLOCK_N_D, BLOCK_KW_D, warps,
               programs an SM)

Each variant is checked against the engine's output on the first layer first; the variants are timed
in rotated order, `--rounds` rounds, medians printed last.

    PYTHONPATH=. python benchmarks/mlp_chain_bench.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from pagedllm.kernels.activation import silu_and_mul  # noqa: E402
from pagedllm.kernels.wna16 import wna16_linear  # noqa: E402
from pagedllm.kernels.wna16_chain_triton import DEFAULT_CONFIG, wna16_mlp_chain  # noqa: E402

HIDDEN, INTER, LAYERS = 4096, 14336, 32
# (each compiles for sm_90 under its register cap without spills, Triton 3.9)
CONFIGS = [DEFAULT_CONFIG, (16, 128, 32, 64, 8, 1), (8, 256, 16, 256, 8, 2), (16, 64, 16, 128, 4, 3),
           (8, 128, 16, 128, 4, 4), (16, 128, 16, 256, 8, 1)]  # fmt: skip


def _layer(dev: str, g: torch.Generator) -> tuple[tuple, tuple]:
    def proj(n: int, k: int) -> tuple:
        words = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32).to(dev)
        scales = (torch.rand(k // 128, n, generator=g) * 0.5 + 0.5) / (8 * k**0.5)
        return words, scales.to(dev, torch.bfloat16), None, True

    return proj(2 * INTER, HIDDEN), proj(HIDDEN, INTER)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    layers = [_layer(dev, g) for _ in range(LAYERS)]
    x0 = torch.randn(1, HIDDEN, generator=g).to(dev, torch.bfloat16)

    def engine(x: torch.Tensor, gu: tuple, dn: tuple) -> torch.Tensor:
        h = wna16_linear(x, gu[0], gu[1], gu[2], 4, kperm=True)
        return wna16_linear(silu_and_mul(h), dn[0], dn[1], dn[2], 4, kperm=True)

    variants = {"engine": engine,
                "staged": lambda x, gu, dn: wna16_mlp_chain(x, gu, dn, DEFAULT_CONFIG, stages=True)}  # fmt: skip
    for cfg in CONFIGS:
        variants[f"chain {cfg}"] = lambda x, gu, dn, cfg=cfg: wna16_mlp_chain(x, gu, dn, cfg)
    ref = engine(x0, *layers[0]).float()
    for name, fn in list(variants.items()):
        try:
            out = fn(x0, *layers[0]).float()
            torch.cuda.synchronize()
            err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
            print(f"{name:40s} first layer: max |diff| / max |ref| {err:.2e}", flush=True)
            if not err < 2e-2:
                raise AssertionError(f"differs from the engine's output ({err:.2e})")
        except Exception as e:  # noqa: BLE001  (a config the compiler refuses, or a wrong one)
            print(f"  {name}: {type(e).__name__}: {e}", flush=True)
            del variants[name]
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for j in range(len(names)):
            name = names[(j + r) % len(names)]
            fn = variants[name]

            def step(fn=fn) -> None:
                x = x0
                for gu, dn in layers:
                    x = fn(x, gu, dn)

            times[name].append(common.graph_time(step, LAYERS))
    print(f"\n{torch.cuda.get_device_name(dev)}: us a layer (median of {args.rounds} rounds; the rounds)")
    base = statistics.median(times["engine"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:40s} {med:7.2f}  x{med / base:.3f}  {[round(t, 2) for t in ts]}")


if __name__ == "__main__":
    main()
