"""The GGUF product (kernels/gguf_kernels.py) against the float32 path on SmolLM2's projection
shapes (qkv 1728x576, gate_up 3072x576, down 576x1536, LM head 49152x576): random blocks, row
counts of a decode step (1, 8, 32) and of a prefill (256); median ms of 20 calls each.
"int8x2" is the default product for Q4_0 / Q4_1 / Q8_0 (activations quantized to int8 with a
second pass for the residual, integer dot products; PAGEDLLM_GGUF_INT8=2), "int8" its one-pass
form (=1); "gguf f32" the float-activation kernel (=0, the K-quants').
float32 is the engine's path for a dequantized model (column-major weight, MKL-packed up to
48 rows); "dequantize + F.linear" is what the GGUF layers do past PREFILL_ROWS rows.

    python benchmarks/gguf_kernels_bench.py --threads 1 --types Q4_1,Q8_0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "unit"))
import common  # noqa: E402
from test_gguf_kernels import random_blocks  # noqa: E402

SHAPES = [(1728, 576), (3072, 576), (576, 1536), (49152, 576)]


def median_ms(fn, n: int = 20) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--types", default="Q4_1,Q8_0")
    p.add_argument("--rows", default="1,8,32,256")
    args = p.parse_args()
    threads = common.set_threads(args.threads)
    from pagedllm.kernels import cpu_gemm, gguf_kernels

    kern = gguf_kernels.kernels()
    print(f"{threads} threads; median ms of 20 calls")
    cols = ("int8", "int8x2", "gguf f32", "float32")
    print(f"{'type':5} {'N x K':>11} {'rows':>5} " + " ".join(f"{c:>9}" for c in cols) + f" {'deq+linear':>11}")
    for qtype in args.types.split(","):
        for n, k in SHAPES:
            w = random_blocks(qtype, n, k)
            wf = gguf_kernels.dequantize_reference(w, qtype, k).t().contiguous().t()
            packed = cpu_gemm.PackedWeight(wf) if cpu_gemm.available() else None
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k)
                int8 = " ".join(f"{median_ms(lambda p=p, x=x, w=w, q=qtype, k=k: kern.matmul(x, w, q, k, int8=p)):9.3f}"
                                if qtype in gguf_kernels.INT8_TYPES else f"{'-':>9}" for p in (1, 2))
                ours = median_ms(lambda: kern.matmul(x, w, qtype, k, int8=0))
                f32 = median_ms(lambda: cpu_gemm.linear(x, wf, None, packed if m <= cpu_gemm.MAX_PACKED_ROWS else None))
                deq = median_ms(lambda: torch.nn.functional.linear(x, kern.dequantize(w, qtype, k)))
                print(f"{qtype:5} {n:>5}x{k:<5} {m:>5} {int8} {ours:>9.3f} {f32:>9.3f} {deq:>11.3f}", flush=True)
    common.print_machine_line(common.machine_info())


if __name__ == "__main__":
    main()
