"""The decode kernels' resource use on the H200, without one: each config of
benchmarks/decode_sweep.py's grid compiled for sm_90 on this machine (Triton's own ptxas) and
read back with cuobjdump -- registers per thread, stack (spills), shared memory -- with the
programs an SM can hold by registers (64K per SM) and by shared memory (227 KB), and whether the
tile loads are asynchronous copies (Triton's pipelining) and 16 bytes wide. A config that spills
or holds one program per SM need not be swept on the device.

    python benchmarks/decode_resources.py [--group 2] [--head-dim 128] [--split]

--split compiles the split-K variants instead: partials + the reduce kernel, and the last split
merging them (PAGEDLLM_DECODE_LAST_REDUCE).

The figures are for this machine's Triton, which may differ from the device's."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REGS_PER_SM = 65536
SHARED_PER_SM = 227 * 1024
MAX_THREADS_PER_SM = 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=2, help="query heads per kv head (Qwen3-0.6B 2, Llama-3.1-8B 4)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--split", action="store_true", help="the split-K variants (reduce kernel / last split)")
    args = ap.parse_args()
    import triton

    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels import attention_merge as am
    from pagedllm.kernels._triton import next_power_of_2
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, resources

    print(f"# decode kernels for sm_90, group {args.group}, head_dim {args.head_dim}, triton {triton.__version__}")
    print(f"{'cache':5s} {'tiles':9s} {'regs':>4s} {'stack':>5s} {'shared':>7s} {'progs/SM':>8s} "
          f"{'warps/SM':>8s} cp.async v4-loads")
    grid = list(itertools.product((64, 128, 256), (4, 8), (2, 3, 4)))
    modes = [(True, False), (True, True)] if args.split else [(False, False)]
    for cache, (bn, warps, stages), (split, last) in itertools.product(("bf16", "fp8e4nv"), grid, modes):
        const = dict(GROUP=args.group, HEAD_DIM=args.head_dim, BLOCK_SIZE=16, BLOCK_N=bn,
                     BLOCK_D=next_power_of_2(args.head_dim), SPLIT=split, SLIDING=False, SOFT_CAP=False,
                     ORDERED=False, BLOCK_G=max(16, next_power_of_2(args.group)), DOT_PRECISION="tf32",
                     Q_AS_FP16=cache != "bf16", LAST_REDUCE=last, BLOCK_S=am.MERGE_BLOCK_S,
                     MERGE_UNROLL=am.MERGE_UNROLL)
        tag = (" split" + (" last" if last else "")) if split else ""
        try:
            compiled = compile_sm90(ad._decode_kernel, decode_signature(cache), const, warps, stages,
                                    aligned=DECODE_STRIDES)
            r = resources(compiled)
        except Exception as exc:  # e.g. out of shared memory
            print(f"{cache:5s} {bn}/{warps}/{stages}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        if r is None:
            sys.exit("decode_resources: Triton's cuobjdump is missing")
        threads = 32 * warps
        progs = min(REGS_PER_SM // max(r["regs"] * threads, 1), SHARED_PER_SM // max(r["shared"], 1),
                    MAX_THREADS_PER_SM // threads)
        print(f"{cache[:5]:5s} {f'{bn}/{warps}/{stages}':9s} {r['regs']:4d} {r['stack']:5d} "
              f"{r['shared']:7d} {progs:8d} {progs * warps:8d} {str(r['cp_async']):8s} {r['v4']}{tag}",
              flush=True)


if __name__ == "__main__":
    main()
