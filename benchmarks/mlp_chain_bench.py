"""Llama-3.1-8B's MLP at one row with 4-bit weights (int4, groups of 128, symmetric, the
steps-permuted layout: W2 gptq's dummy weights), 32 layers chained (each layer's output the next
one's input) in a CUDA graph, distinct weights a layer (none from L2), us a layer:

    engine     wna16_linear(gate_up) -> silu_and_mul -> wna16_linear(down): the engine's three
               kernels (gemvp, PDL where the engine takes it)
    staged     wna16_mlp_chain a stage a launch (two kernels, no barrier)
    chain ...  wna16_mlp_chain's persistent kernel (kernels/wna16_chain_triton.py) at the configs
               given (BLOCK_N_GU, BLOCK_KW_GU, BLOCK_N_D, BLOCK_KW_D, warps,
               programs an SM)

--with-o puts Llama's o projection, the residual add and the RMSNorm before each MLP (the engine's
wna16_linear + fused_add_rms_norm; the chain kernel's o stage). Each variant is checked against the
engine's output on the first layer first; the variants are timed in rotated order, `--rounds` rounds,
medians printed last.

    PYTHONPATH=. python benchmarks/mlp_chain_bench.py [--rounds 3] [--with-o]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from pagedllm.kernels.activation import silu_and_mul  # noqa: E402
from pagedllm.kernels.norm import fused_add_rms_norm  # noqa: E402
from pagedllm.kernels.wna16 import wna16_linear  # noqa: E402
from pagedllm.kernels.wna16_chain_triton import DEFAULT_CONFIG, wna16_mlp_chain  # noqa: E402

HIDDEN, INTER, LAYERS = 4096, 14336, 32
# (each compiles for sm_90 under its register cap without spills, Triton 3.9)
CONFIGS = [DEFAULT_CONFIG, (16, 128, 32, 64, 8, 1), (8, 256, 16, 256, 8, 2), (16, 64, 16, 128, 4, 3),
           (8, 128, 16, 128, 4, 4), (16, 128, 16, 256, 8, 1)]  # fmt: skip


def _layer(dev: str, g: torch.Generator) -> tuple[tuple, tuple, tuple]:
    def proj(n: int, k: int) -> tuple:
        words = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32).to(dev)
        scales = (torch.rand(k // 128, n, generator=g) * 0.5 + 0.5) / (8 * k**0.5)
        return words, scales.to(dev, torch.bfloat16), None, True

    return proj(2 * INTER, HIDDEN), proj(HIDDEN, INTER), proj(HIDDEN, HIDDEN)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--with-o", action="store_true", help="o, the residual add and RMSNorm before each MLP "
                    "(the engine: wna16_linear(o) and fused_add_rms_norm first; the chain: its o stage)")  # fmt: skip
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    layers = [_layer(dev, g) for _ in range(LAYERS)]
    x0 = torch.randn(1, HIDDEN, generator=g).to(dev, torch.bfloat16)
    res0 = torch.randn(1, HIDDEN, generator=g).to(dev, torch.bfloat16)
    norm = (torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16), 1e-5)

    # a variant: (x, residual, gate_up, down, o) -> (the next layer's x, residual)
    def engine(x: torch.Tensor, res: torch.Tensor, gu: tuple, dn: tuple, o: tuple) -> tuple:
        if args.with_o:
            x, res = fused_add_rms_norm(wna16_linear(x, o[0], o[1], o[2], 4, kperm=True), res, *norm)
        h = wna16_linear(x, gu[0], gu[1], gu[2], 4, kperm=True)
        return wna16_linear(silu_and_mul(h), dn[0], dn[1], dn[2], 4, kperm=True), res

    def chain(cfg: tuple, **kw) -> Callable:
        def run(x: torch.Tensor, res: torch.Tensor, gu: tuple, dn: tuple, o: tuple) -> tuple:
            if args.with_o:
                return wna16_mlp_chain(x, gu, dn, cfg, o=o, residual=res, norm=norm, **kw)
            return wna16_mlp_chain(x, gu, dn, cfg, **kw), res

        return run

    variants = {"engine": engine, "staged": chain(DEFAULT_CONFIG, stages=True)}
    for cfg in CONFIGS:
        variants[f"chain {cfg}"] = chain(cfg)
    ref = engine(x0, res0, *layers[0])[0].float()
    for name, fn in list(variants.items()):
        try:
            out = fn(x0, res0, *layers[0])[0].float()
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
                x, res = x0, res0
                for layer in layers:
                    x, res = fn(x, res, *layer)

            times[name].append(common.graph_time(step, LAYERS))
    print(f"\n{torch.cuda.get_device_name(dev)}: us a layer (median of {args.rounds} rounds; the rounds)")
    base = statistics.median(times["engine"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:40s} {med:7.2f}  x{med / base:.3f}  {[round(t, 2) for t in ts]}")


if __name__ == "__main__":
    main()
