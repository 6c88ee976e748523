"""How fast can a kernel merely read W2's 4-bit weights? Pure streaming kernels (no dequantization, no
activations: each program sums the int32 words it reads) over Llama-3.1-8B's four int4 projections
(words [K / 8, N]), inside a CUDA graph of 32 layers with distinct weights, as wna16_bench.py times
gemvp. It separates what gemvp's time owes to its access pattern and launch from what it owes to its
arithmetic (issue 19's W2: gemvp took 58% of the H100's bandwidth over a step, RESULTS.md):

    strided  gemvp's pattern: a program owns BLOCK_N columns (and a K range with split-K) of the
             row-major [K / 8, N] words, [BLOCK_KW, BLOCK_N] tiles, rows N * 4 bytes apart
    tiled    the same programs, each column block's words stored contiguously ([N / BLOCK_N, K / 8,
             BLOCK_N]): a program streams one contiguous range
    flat     the words as one array split evenly over `programs` programs, each one contiguous
             range in 16-byte vectors: no column blocks at all (the ceiling for the byte count)

Prints us a layer and TB/s per projection and pattern, then the four projections chained as a
decoder layer's are (qkv, o, gate_up, down) x 32 layers, ms a step (gemvp's pattern also under PDL, its
first tile's words loaded before the wait as gemvp's are): against gemvp's ~1.86 ms on the
H100 (RESULTS.md eighteenth session) that is how much of the GEMVs' time the pattern sets.

    PYTHONPATH=. python benchmarks/stream_bench.py [--quick]

--persistent llama|moe streams a whole step (Llama-3.1-8B's int4 words x 32 layers; Qwen3-30B-A3B's bf16
weights a token reads at batch 1, 48 layers) in one persistent launch, each projection split evenly over
its programs, without and with a grid barrier between projections (the next projection's first words
loaded before the wait), against flat's chain of one kernel a projection -- what fewer, longer kernels
could gain (RESULTS.md, twenty-ninth session):

    PYTHONPATH=. python benchmarks/stream_bench.py --persistent llama moe

--tma llama|moe streams the same steps as a chain of one kernel a projection, flat's register loads against
TMA boxes in shared memory at several depths (RESULTS.md, thirty-first session: TMA 2-5% slower on the H100):

    PYTHONPATH=. python benchmarks/stream_bench.py --tma llama moe
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
from fp8_bench import LAYERS, SHAPES, graph_time  # noqa: E402

from pagedllm.kernels._triton import pdl  # noqa: E402
from pagedllm.kernels.pdl_triton import pdl_release, pdl_wait  # noqa: E402


@triton.jit
def _strided_kernel(w_ptr, out_ptr, KW, N, KW_PER_SPLIT, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                    STAGES: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_release(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, BLOCK_KW)
    lo = tl.program_id(1) * KW_PER_SPLIT
    acc = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.int32)
    if TILED:  # the column block's words contiguous: [N / BLOCK_N, KW, BLOCK_N]
        base = w_ptr + tl.program_id(0).to(tl.int64) * KW * BLOCK_N
    if PDL:  # as gemvp under PDL: the first tile's words (through L2) before the wait, the rest after
        acc += tl.load(w_ptr + (lo + ri)[:, None] * N + rn[None, :], cache_modifier=".cg")
        lo += BLOCK_KW
    pdl_wait(PDL)
    for kw0 in tl.range(lo, tl.program_id(1) * KW_PER_SPLIT + KW_PER_SPLIT, BLOCK_KW, num_stages=STAGES):
        rows = kw0 + ri
        if TILED:
            w = tl.load(base + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
        else:
            w = tl.load(w_ptr + rows[:, None] * N + rn[None, :])
        acc += w
    tl.store(out_ptr + tl.program_id(1) * N + rn, tl.sum(acc, axis=0))


@triton.jit
def _flat_kernel(w_ptr, out_ptr, TOTAL, PER_PROGRAM, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    lo = tl.program_id(0).to(tl.int64) * PER_PROGRAM
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(0, PER_PROGRAM, BLOCK, num_stages=STAGES):
        offs = lo + i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < TOTAL, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _persistent_kernel(ptrs_ptr, sizes_ptr, cnt_ptr, out_ptr, S, P, BLOCK: tl.constexpr, PRE: tl.constexpr,
                       STAGES: tl.constexpr, SYNC: tl.constexpr):  # fmt: skip
    """Every stage (projection) of the step in one launch: stage s's words (a contiguous array at
    ptrs[s], sizes[s] words) split evenly over the P programs, as flat's; with SYNC a grid barrier
    between stages (a program counts itself done in cnt[s], then spins until all P have), the next
    stage's first PRE words loaded before the spin -- as a decode step's GEMVs would stream their
    weights across the dependency on their input."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    pre_offs = tl.arange(0, PRE)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    acc_pre = tl.full([], 0, tl.int32)  # the prefetched words' sum
    for s in range(S):
        w = tl.load(ptrs_ptr + s).to(tl.pointer_type(tl.int32))
        total = tl.load(sizes_ptr + s)
        per = tl.cdiv(tl.cdiv(total, P), BLOCK) * BLOCK
        lo = pid * per
        hi = tl.minimum(lo + per, total)
        pre = tl.load(w + lo + pre_offs, mask=lo + pre_offs < hi, other=0, cache_modifier=".cg")
        if SYNC:
            if s > 0:  # the barrier after stage s - 1
                seen = tl.atomic_add(cnt_ptr + s - 1, 0, sem="acquire")
                while seen < P:
                    seen = tl.atomic_add(cnt_ptr + s - 1, 0, sem="acquire")
        acc_pre += tl.sum(pre, axis=0)
        for i in tl.range(lo + PRE, hi, BLOCK, num_stages=STAGES):
            acc += tl.load(w + i + offs, mask=i + offs < hi, other=0)
        if SYNC:
            tl.atomic_add(cnt_ptr + s, 1, sem="release")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0) + acc_pre)


@triton.jit
def _tma_kernel(desc, out_ptr, ROWS, PER_PROGRAM, BLOCK_R: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr):
    """flat's streaming through the Hopper's tensor memory accelerator: the words viewed as [ROWS, COLS],
    program p reading rows [p * PER_PROGRAM, (p + 1) * PER_PROGRAM) in [BLOCK_R, COLS] boxes, STAGES boxes in
    flight in shared memory (no registers held by the loads in flight; rows past ROWS read as zeros)."""
    lo = tl.program_id(0) * PER_PROGRAM
    acc = tl.zeros([BLOCK_R, COLS], dtype=tl.int32)
    for r in tl.range(lo, tl.minimum(lo + PER_PROGRAM, ROWS), BLOCK_R, num_stages=STAGES):
        acc += desc.load([r, 0])
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def tma_desc(w: torch.Tensor, block_r: int, cols: int = 256):
    from triton.tools.tensor_descriptor import TensorDescriptor

    v = w.view(-1, cols)
    return TensorDescriptor(v, list(v.shape), list(v.stride()), [block_r, cols])


def tma(desc, rows: int, out: torch.Tensor, cfg: tuple) -> int:
    """Launches _tma_kernel over rows [0, rows) of desc; returns its program count (out's sums written)."""
    programs, block_r, warps, stages = cfg
    per = triton.cdiv(triton.cdiv(rows, programs), block_r) * block_r
    launched = triton.cdiv(rows, per)
    _tma_kernel[(launched,)](desc, out, rows, per, BLOCK_R=block_r, COLS=desc.block_shape[1], STAGES=stages,
                             num_warps=warps)  # fmt: skip
    return launched


def tma_chain(seq: list[torch.Tensor], label: str, sms: int, quick: bool) -> None:
    """A step's projections (seq, in order) streamed by a chain of kernels, one a projection: flat's register
    loads against TMA boxes (_tma_kernel) at several depths (ms a step; the sums checked once)."""
    out = torch.empty(8 * sms, dtype=torch.int32, device=seq[0].device)
    total = sum(w.numel() * 4 for w in seq)
    print(f"{label}: {len(seq)} projections, {total / 1e9:.2f} GB a step; a chain of one kernel a projection")
    for cfg in [(sms, 2048, 8, 3), (2 * sms, 2048, 8, 3), (2 * sms, 4096, 8, 3)][: 1 if quick else 3]:
        t = common.graph_time(lambda cfg=cfg: [flat(w, out, cfg) for w in seq])
        print(f"  flat {str(cfg):26s} {t / 1000:.3f} ms a step ({total / t / 1e6:.2f} TB/s)")
    # (programs, BLOCK_R rows of 256 words, warps, stages): 16-64 KB boxes, 2-5 in flight a program
    cfgs = [(sms, 32, 4, 3), (sms, 32, 4, 4), (sms, 32, 8, 5), (sms, 16, 4, 6), (2 * sms, 16, 4, 4),
            (2 * sms, 32, 4, 3), (sms, 64, 8, 3), (4 * sms, 16, 4, 3)]  # fmt: skip
    for cfg in cfgs[: 2 if quick else None]:
        descs = [tma_desc(w, cfg[1]) for w in seq]
        rows = [w.numel() // 256 for w in seq]
        try:
            n = tma(descs[0], rows[0], out, cfg)
            torch.cuda.synchronize()
            got = int(out[:n].sum(dtype=torch.int64)) % (1 << 32)
            assert got == int(seq[0].sum(dtype=torch.int64)) % (1 << 32), "TMA sums differ"
            t = common.graph_time(lambda cfg=cfg, descs=descs, rows=rows: [tma(d, r, out, cfg)
                                                                           for d, r in zip(descs, rows)])
        except Exception as e:  # noqa: BLE001  (a config the compiler refuses)
            print(f"  tma {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  tma  {str(cfg):26s} {t / 1000:.3f} ms a step ({total / t / 1e6:.2f} TB/s)")


def persistent(ptrs: torch.Tensor, sizes: torch.Tensor, cnt: torch.Tensor, out: torch.Tensor, cfg: tuple,
               sync: bool) -> None:  # fmt: skip
    programs, block, pre, warps, stages = cfg
    if sync:
        cnt.zero_()
    _persistent_kernel[(programs,)](ptrs, sizes, cnt, out, ptrs.numel(), programs, BLOCK=block, PRE=pre,
                                    STAGES=stages, SYNC=sync, num_warps=warps)  # fmt: skip


# Qwen3-30B-A3B's bf16 weights a layer at batch 1 (issue 15), in int32 words: qkv, o, the router, the 8 routed
# experts' gate_up and down
MOE_STAGES = {"qkv": 5120 * 2048 // 2, "o": 2048 * 4096 // 2, "router": 128 * 2048 // 2,
              "gate_up": 8 * 1536 * 2048 // 2, "down": 8 * 2048 * 768 // 2}  # fmt: skip
MOE_LAYERS = 48


def persistent_chain(seq: list[torch.Tensor], label: str, sms: int, quick: bool) -> None:
    """A step's projections (seq, in order) streamed by one persistent kernel, with and without its
    grid barriers, against flat's chain of kernels (printed as ms a step)."""
    dev = "cuda"
    ptrs = torch.tensor([w.data_ptr() for w in seq], dtype=torch.int64, device=dev)
    sizes = torch.tensor([w.numel() for w in seq], dtype=torch.int64, device=dev)
    cnt = torch.zeros(len(seq), dtype=torch.int32, device=dev)
    out = torch.empty(8 * sms, dtype=torch.int32, device=dev)
    total = sum(w.numel() * 4 for w in seq)
    print(f"{label}: {len(seq)} projections, {total / 1e9:.2f} GB a step")
    # the sums, once: each stage's words summed by the kernel equal torch's (int32 wraps alike)
    ref = sum(int(w.sum(dtype=torch.int64)) for w in seq) % (1 << 32)
    # (programs, BLOCK, PRE, warps, stages)
    cfgs = [(sms, 4096, 8192, 8, 3), (sms, 4096, 16384, 8, 3), (sms, 4096, 16384, 8, 4), (sms, 8192, 16384, 8, 3),
            (sms, 4096, 32768, 8, 3), (2 * sms, 2048, 8192, 8, 3), (sms, 2048, 8192, 8, 3)]  # fmt: skip
    if quick:
        cfgs = cfgs[:2]
    for cfg in cfgs:
        for sync in (False, True):
            try:
                persistent(ptrs, sizes, cnt, out, cfg, sync)
                torch.cuda.synchronize()
                got = int(out[: cfg[0]].sum(dtype=torch.int64)) % (1 << 32)
                assert got == ref, f"persistent sums differ: {got} != {ref}"
                t = common.graph_time(lambda cfg=cfg, sync=sync: persistent(ptrs, sizes, cnt, out, cfg, sync))
            except Exception as e:  # noqa: BLE001  (a config the compiler refuses)
                print(f"  persistent {cfg} sync={sync}: {type(e).__name__}: {e}")
                continue
            print(f"  persistent {str(cfg):28s} {'barriers' if sync else 'no barriers':12s} {t / 1000:.3f} ms a step "
                  f"({total / t / 1e6:.2f} TB/s)")  # fmt: skip
    for cfg in [(sms, 2048, 8, 3), (2 * sms, 2048, 8, 3), (4 * sms, 1024, 8, 3), (2 * sms, 4096, 8, 3)]:
        t = common.graph_time(lambda cfg=cfg: [flat(w, out, cfg) for w in seq])
        print(f"  flat chain of kernels {str(cfg):20s} {t / 1000:.3f} ms a step ({total / t / 1e6:.2f} TB/s)")


def strided(w: torch.Tensor, out: torch.Tensor, cfg: tuple, tiled: bool, under_pdl: bool = False) -> None:
    block_n, block_kw, warps, stages, split = cfg
    kw, n = (w.shape[1], w.shape[0] * w.shape[2]) if tiled else w.shape
    per = kw // split
    opts = pdl(w) if under_pdl and not tiled else {}
    _strided_kernel[(n // block_n, split)](w, out, kw, n, per, BLOCK_N=block_n, BLOCK_KW=block_kw, STAGES=stages,
                                           TILED=tiled, num_warps=warps, **opts)  # fmt: skip


def flat(w: torch.Tensor, out: torch.Tensor, cfg: tuple) -> None:
    programs, block, warps, stages = cfg
    per = triton.cdiv(triton.cdiv(w.numel(), programs), block) * block  # the last program's range ragged
    _flat_kernel[(programs,)](w, out, w.numel(), per, BLOCK=block, STAGES=stages, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    ap.add_argument("--tma", nargs="+", choices=["llama", "moe"],
                    help="only the step (as --persistent's) as a chain of one kernel a projection: flat's register "
                    "loads against TMA boxes")  # fmt: skip
    ap.add_argument("--persistent", nargs="+", choices=["llama", "moe"],
                    help="only the step (Llama-3.1-8B int4 / Qwen3-30B-A3B bf16 at batch 1) in one persistent kernel "
                    "against flat's chain of kernels")  # fmt: skip
    args = ap.parse_args()
    dev = "cuda"
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; us a layer (CUDA graph of {LAYERS}), TB/s of words")
    # (BLOCK_N, BLOCK_KW, warps, stages, split); gemvp's configs first (gemvp_config: 1,024 inputs = 128 words)
    strided_cfgs = {
        "qkv": [(64, 128, 8, 1, 1), (32, 64, 8, 4, 2), (64, 64, 8, 3, 2), (128, 64, 8, 3, 1)],
        "o": [(32, 64, 8, 4, 1), (32, 64, 8, 3, 2), (64, 64, 8, 3, 2), (128, 32, 8, 4, 2)],
        "gate_up": [(32, 128, 8, 1, 1), (64, 128, 8, 3, 1), (128, 64, 8, 3, 1), (256, 32, 8, 3, 1)],
        "down": [(32, 64, 8, 1, 4), (32, 64, 8, 3, 4), (64, 64, 8, 3, 4), (128, 64, 8, 3, 2)],
    }
    flat_cfgs = [(sms, 2048, 8, 3), (2 * sms, 2048, 8, 3), (4 * sms, 1024, 8, 3), (8 * sms, 1024, 4, 3)]
    if args.quick:
        strided_cfgs = {k: v[:2] for k, v in strided_cfgs.items()}
        flat_cfgs = flat_cfgs[:2]
    best: dict[str, dict[str, tuple[float, tuple]]] = {}
    words: dict[str, list[torch.Tensor]] = {}
    if args.persistent or args.tma:

        def rand(*shape: int) -> torch.Tensor:
            return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=dev)

        run = tma_chain if args.tma else persistent_chain
        if args.tma:  # (as when it was measured, 38f945c: global scratch for Triton's TMA kernels)
            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
        steps = {"llama": (lambda: [rand(k // 8, n) for _ in range(LAYERS) for n, k in SHAPES.values()],
                           f"Llama-3.1-8B int4 words, {LAYERS} layers"),
                 "moe": (lambda: [rand(n) for _ in range(MOE_LAYERS) for n in MOE_STAGES.values()],
                         f"Qwen3-30B-A3B bf16 at batch 1, {MOE_LAYERS} layers")}  # fmt: skip
        for name in args.tma or args.persistent:
            make, label = steps[name]
            run(make(), label, sms, args.quick)  # (each step's words freed before the next's)
        return
    for name, (n, k) in SHAPES.items():
        kw = k // 8
        ws = [torch.randint(-(2**31), 2**31 - 1, (kw, n), dtype=torch.int32, device=dev) for _ in range(LAYERS)]
        words[name] = ws
        nbytes = kw * n * 4
        out = torch.empty(8 * n + 8 * sms, dtype=torch.int32, device=dev)
        best[name] = {}
        for pattern in ("strided", "tiled", "flat"):
            cfgs = flat_cfgs if pattern == "flat" else strided_cfgs[name]
            for cfg in cfgs:
                if pattern == "flat":
                    fn = lambda cfg=cfg, ws=ws, out=out: [flat(w, out, cfg) for w in ws]  # noqa: E731
                elif pattern == "tiled":
                    tws = [w.view(kw, n // cfg[0], cfg[0]).transpose(0, 1).contiguous() for w in ws]
                    # the same sums as strided's: check once
                    ref = torch.empty_like(out)
                    strided(ws[0], ref, cfg, False)
                    strided(tws[0], out, cfg, True)
                    assert torch.equal(ref[: cfg[4] * n], out[: cfg[4] * n]), "tiled sums differ"
                    fn = lambda cfg=cfg, tws=tws, out=out: [strided(w, out, cfg, True) for w in tws]  # noqa: E731
                else:
                    fn = lambda cfg=cfg, ws=ws, out=out: [strided(w, out, cfg, False) for w in ws]  # noqa: E731
                try:
                    t = graph_time(fn)
                except Exception as e:  # noqa: BLE001  (a config the compiler refuses)
                    print(f"  {name} {pattern} {cfg}: {type(e).__name__}")
                    continue
                print(f"  {name:8s} {pattern:8s} {str(cfg):24s} {t:7.2f} us  {nbytes / t / 1e6:5.2f} TB/s")
                if pattern not in best[name] or t < best[name][pattern][0]:
                    best[name][pattern] = (t, cfg)
                if pattern == "tiled":
                    del tws
    print("\nbest per projection (us a layer):")
    for name, b in best.items():
        print(f"  {name:8s} " + "  ".join(f"{p} {t:6.2f} {cfg}" for p, (t, cfg) in b.items()))
    # the chain: qkv, o, gate_up, down per layer, each at its best strided / flat config
    for pattern in ("strided", "strided under PDL", "flat"):  # (PDL: the first tile before the wait, as gemvp)
        outs = {name: torch.empty(8 * SHAPES[name][0] + 8 * sms, dtype=torch.int32, device=dev) for name in SHAPES}

        def chain(pattern=pattern, outs=outs):
            for i in range(LAYERS):
                for name in SHAPES:
                    if pattern == "flat":
                        flat(words[name][i], outs[name], best[name]["flat"][1])
                    else:
                        strided(words[name][i], outs[name], best[name]["strided"][1], False, pattern != "strided")

        t = graph_time(lambda: chain()) * LAYERS / 1000
        total = sum(k // 8 * n * 4 for n, k in SHAPES.values()) * LAYERS
        print(
            f"chain of the four x {LAYERS} layers, {pattern} at its bests: {t:.3f} ms a step "
            f"({total / t / 1e9:.2f} TB/s)"
        )


if __name__ == "__main__":
    main()
