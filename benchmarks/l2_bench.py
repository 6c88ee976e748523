"""Does a few-row linear run faster when its weight already sits in L2, and can a decode step get it
there while the memory is otherwise idle? The question behind asking L2 for the o projection's weight
during attention (tried in the twenty-fourth session from inside the decode kernel and from a side
stream, and the MoE down kernel's evict-last prefetch: none kept, RESULTS.md). In CUDA graphs of
LAYERS distinct weights (so nothing stays in L2 from one layer to the next), us a layer:

    cold       sleep, then the linear                                    (less "sleep")
    warm       the linear twice on the same weight: the second's time    ("twice" less "cold")
    prefetched a bulk L2 prefetch of the weight (P programs), sleep, then the linear
                                                                         (less "prefetch + sleep")
    side       the prefetch on a side stream forked before the sleep, joined after the last layer;
               the sleep and the linear on the main stream               (less "sleep")

`sleep` (torch.cuda._sleep) stands for the attention the prefetch would hide behind, long enough for
the prefetch to land. Shapes: Qwen3-30B-A3B's o projection (2048 x 4096) and q/k/v (5120 x 2048),
Llama-3.1-8B's o (4096 x 4096), bf16, 1 row, through small_m_linear (the swap-AB kernel) or
F.linear where that answers cuBLAS.

    PYTHONPATH=. python benchmarks/l2_bench.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from pagedllm.kernels import small_m  # noqa: E402
from pagedllm.kernels.pdl_triton import prefetch_rows_l2  # noqa: E402

LAYERS = 32
SHAPES = {"moe_o": (2048, 4096), "moe_qkv": (5120, 2048), "llama_o": (4096, 4096)}
SIDE_PROGRAMS = 64
CHUNKS = 128  # bulk prefetches a program (one a thread at 4 warps)


@triton.jit
def _prefetch_kernel(w_ptr, nbytes, CHUNKS: tl.constexpr):
    """The grid's programs ask L2 for the nbytes bytes at w_ptr, evenly shared: CHUNKS bulk
    prefetches a program (prefetch_rows_l2 with each chunk a "row" of bytes)."""
    unit = 16 * CHUNKS
    per = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), unit) * unit
    chunk = per // CHUNKS
    starts = tl.program_id(0).to(tl.int64) * per + tl.arange(0, CHUNKS).to(tl.int64) * chunk
    sizes = tl.minimum(tl.maximum(nbytes - starts, 0), chunk)
    prefetch_rows_l2(w_ptr.to(tl.pointer_type(tl.uint8)) + starts, sizes > 0, 0, sizes, 1 << 30)


def prefetch(w: torch.Tensor, programs: int) -> None:
    _prefetch_kernel[(programs,)](w, w.numel() * w.element_size(), CHUNKS=CHUNKS, num_warps=4)


def side_prefetch(ws: list[torch.Tensor], x: torch.Tensor, cycles: int, side: torch.cuda.Stream) -> None:
    """Each weight asked of L2 from the side stream, forked after the linear before it; the main
    stream sleeping then running the linear; one join at the end."""
    main = torch.cuda.current_stream()
    for w in ws:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch(w, SIDE_PROGRAMS)
        torch.cuda._sleep(cycles)
        linear(x, w)
    main.wait_stream(side)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    cfg = small_m.pick(x, w)
    return torch.nn.functional.linear(x, w) if cfg is None else small_m.small_m_linear(x, w, config=cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep-us", type=float, default=12.0)
    ap.add_argument("--programs", type=int, nargs="*", default=[132, 32])
    args = ap.parse_args()
    clock_khz = (
        torch.cuda.get_device_properties(0).clock_rate
        if hasattr(torch.cuda.get_device_properties(0), "clock_rate")
        else 1_980_000
    )
    cycles = int(args.sleep_us * clock_khz / 1e3)
    print(f"{torch.cuda.get_device_name()}; sleep {args.sleep_us} us = {cycles} cycles; {LAYERS} layers a graph")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
        print(f"{name} {n}x{k} ({n * k * 2 / 1e6:.1f} MB): " + measure(ws, x, cycles, args.programs) + "  us a layer")


def measure(ws: list[torch.Tensor], x: torch.Tensor, cycles: int, programs: list[int]) -> str:
    def t(fn) -> float:
        return common.graph_time(fn, LAYERS, 20, 5)

    sleep = t(lambda: [torch.cuda._sleep(cycles) for _ in ws])
    once = t(lambda: [linear(x, w) for w in ws])
    cold = t(lambda: [(torch.cuda._sleep(cycles), linear(x, w)) for w in ws]) - sleep
    twice = t(lambda: [(linear(x, w), linear(x, w)) for w in ws])
    row = [f"alone {once:.2f}, cold {cold:.2f}, warm {twice - once:.2f}"]
    for p in programs:
        base = t(lambda p=p: [(prefetch(w, p), torch.cuda._sleep(cycles)) for w in ws])
        pre = t(lambda p=p: [(prefetch(w, p), torch.cuda._sleep(cycles), linear(x, w)) for w in ws]) - base
        alone = t(lambda p=p: [prefetch(w, p) for w in ws])
        row.append(f"prefetched by {p} programs {pre:.2f} (the prefetch kernel alone {alone:.2f})")
    stream = torch.cuda.Stream()
    side = t(lambda: side_prefetch(ws, x, cycles, stream)) - sleep
    row.append(f"prefetched from the side stream ({SIDE_PROGRAMS} programs) {side:.2f}")
    return "; ".join(row)


if __name__ == "__main__":
    main()
