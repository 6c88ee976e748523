"""The fused Triton sampler alone on the GPU (us per call, a CUDA graph of it replayed): one
program per row (`chunks=1`) against the default split over column chunks, at W1's vocabulary
(151,936) and temperature 0.6, for several row counts.

    python3 benchmarks/sampler_bench.py [--rows 256 64 24 1] [--vocab 151936]
"""

from __future__ import annotations

import argparse

import torch
import triton

from pagedllm.kernels.sampling_triton import sample_triton


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 64, 24, 1])
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    for s in args.rows:
        x = torch.randn(s, args.vocab, device="cuda", dtype=torch.bfloat16)
        t = torch.full((s,), 0.6, device="cuda")
        g = torch.zeros(s, dtype=torch.bool, device="cuda")
        seed = torch.tensor([3], device="cuda")
        us = {}
        for ch in (1, None):
            us[ch] = 1e3 * triton.testing.do_bench_cudagraph(
                lambda x=x, t=t, g=g, seed=seed, ch=ch: sample_triton(x, t, g, seed, chunks=ch))
        print(f"sampler {s:>4} rows x {args.vocab}: one program a row {us[1]:7.1f} us, split {us[None]:7.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
