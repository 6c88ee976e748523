"""Does a few-row linear run faster when its weight already sits in L2, and can a decode step get it
there while the memory is otherwise idle? The question behind asking L2 for the o projection's weight
during attention (tried in the twenty-fourth session from inside the decode kernel and from a side
stream, and the MoE down kernel's evict-last prefetch: none kept, RESULTS.md). In CUDA graphs of
LAYERS distinct weights (so nothing stays in L2 from one layer to the next), us a layer:

    cold       sleep, then the linear                                    (less "sleep")
    warm       the linear twice on the same weight: the second's time    ("twice" less "alone")
    prefetched a bulk L2 prefetch of the weight (P programs), sleep, then the linear
                                                                         (less "prefetch + sleep")
    side       the prefetch on a side stream forked before the sleep, joined after the last layer;
               the sleep and the linear on the main stream               (less "sleep")

`sleep` (torch.cuda._sleep) stands for the attention the prefetch would hide behind, long enough for
the prefetch to land. Shapes: Qwen3-30B-A3B's o projection (2048 x 4096) and q/k/v (5120 x 2048),
Llama-3.1-8B's o (4096 x 4096), bf16, 1 row, through small_m_linear (the swap-AB kernel) or
F.linear where that answers cuBLAS. --survive: whether a prefetched weight outlives another kernel's
50 MB stream through L2 (the MoE gate/up kernel's, say), prefetched normally or evict-last, without
and with a persisting L2 set-aside (cudaLimitPersistingL2CacheSize; on the H100 the evict-last lines
survived without one, RESULTS.md twenty-fourth session).

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


@triton.jit
def _prefetch_last_kernel(w_ptr, nbytes, CHUNKS: tl.constexpr):
    """_prefetch_kernel with an evict-last L2 policy on each bulk prefetch."""
    unit = 16 * CHUNKS
    per = tl.cdiv(tl.cdiv(nbytes, tl.num_programs(0)), unit) * unit
    chunk = per // CHUNKS
    starts = tl.program_id(0).to(tl.int64) * per + tl.arange(0, CHUNKS).to(tl.int64) * chunk
    sizes = (tl.minimum(tl.maximum(nbytes - starts, 0), chunk) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        .reg .b64 pol;
        setp.gt.s32 p, $2, 0;
        createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
        @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[(w_ptr.to(tl.pointer_type(tl.uint8)) + starts).to(tl.int64), sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _stream_kernel(buf_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Reads the program's share of n int32 words (another kernel's weights streaming through L2)."""
    per = tl.cdiv(tl.cdiv(n, tl.num_programs(0)), BLOCK) * BLOCK
    lo = tl.program_id(0).to(tl.int64) * per
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, per, BLOCK):
        offs = lo + i + tl.arange(0, BLOCK)
        acc += tl.load(buf_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def set_persisting_l2(nbytes: int) -> bool:
    """cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, nbytes) through the process's libcudart;
    False where it cannot be found or refuses."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart" in line})
    if not paths:
        return False
    return ctypes.CDLL(paths[0]).cudaDeviceSetLimit(ctypes.c_int(6), ctypes.c_size_t(nbytes)) == 0


def survive(ws: list[torch.Tensor], x: torch.Tensor, stream_mb: int) -> str:
    """Each weight prefetched (normal or evict-last), then stream_mb of other data read, then the
    linear: does the weight outlive the stream in L2? us a layer of the linear (less prefetch +
    stream), against no prefetch."""
    words = stream_mb * (1 << 20) // 4
    bufs = [torch.ones(words, dtype=torch.int32, device="cuda") for _ in ws]
    out = torch.empty(132, dtype=torch.int32, device="cuda")

    def t(fn) -> float:
        return common.graph_time(fn, LAYERS, 20, 5)

    def stream(b):
        _stream_kernel[(132,)](b, out, b.numel(), BLOCK=1024, num_warps=4)

    def pre(kernel, w):
        kernel[(132,)](w, w.numel() * w.element_size(), CHUNKS=CHUNKS, num_warps=4)

    row = []
    base = t(lambda: [stream(b) for b in bufs])
    row.append(f"none {t(lambda: [(stream(b), linear(x, w)) for w, b in zip(ws, bufs)]) - base:.2f}")
    for label, kernel in (("normal", _prefetch_kernel), ("evict-last", _prefetch_last_kernel)):
        base = t(lambda k=kernel: [(pre(k, w), stream(b)) for w, b in zip(ws, bufs)])
        lin = t(lambda k=kernel: [(pre(k, w), stream(b), linear(x, w)) for w, b in zip(ws, bufs)]) - base
        row.append(f"{label} {lin:.2f}")
    return f"after {stream_mb} MB streamed: " + ", ".join(row)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    cfg = small_m.pick(x, w)
    return torch.nn.functional.linear(x, w) if cfg is None else small_m.small_m_linear(x, w, config=cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep-us", type=float, default=12.0)
    ap.add_argument("--programs", type=int, nargs="*", default=[132, 32])
    ap.add_argument(
        "--survive",
        action="store_true",
        help="only the prefetch-then-stream test, without and with a "
        "persisting L2 set-aside (cudaLimitPersistingL2CacheSize)",
    )
    ap.add_argument("--stream-mb", type=int, default=50)
    ap.add_argument("--set-aside-mb", type=int, default=30)
    args = ap.parse_args()
    clock_khz = (
        torch.cuda.get_device_properties(0).clock_rate
        if hasattr(torch.cuda.get_device_properties(0), "clock_rate")
        else 1_980_000
    )
    cycles = int(args.sleep_us * clock_khz / 1e3)
    print(f"{torch.cuda.get_device_name()}; sleep {args.sleep_us} us = {cycles} cycles; {LAYERS} layers a graph")
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.survive:
        n, k = SHAPES["moe_o"]
        ws = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.bfloat16)
        print(f"moe_o, no set-aside: {survive(ws, x, args.stream_mb)}  us a layer")
        ok = set_persisting_l2(args.set_aside_mb << 20)
        print(
            f"moe_o, {args.set_aside_mb} MB set aside ({'set' if ok else 'NOT set'}): "
            f"{survive(ws, x, args.stream_mb)}  us a layer"
        )
        return
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
