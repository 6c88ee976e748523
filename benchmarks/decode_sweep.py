"""The paged decode kernels' tiles at W1's shape, bf16 and FP8 caches (issues 13 and 14): each
(BLOCK_N, num_warps, num_stages) checked against the torch reference and timed with
triton.testing.do_bench (median). Qwen3-0.6B's attention (16 query heads, 8 kv heads, head_dim
128), block size 16, 256 requests with W1's context lengths (100-1024 prompt + up to 1024
generated: uniform 100-2048 here) and with 1,024 each; the split count is the engine's
(decode_num_splits with the CUDA graphs' max_seq_len bound).

    python benchmarks/decode_sweep.py [--out best.json]
    python benchmarks/decode_sweep.py --order-ab       # longest-first program order, a few tiles
    python benchmarks/decode_sweep.py --last-reduce-ab # reduce kernel vs the last split's merge, ~1 min
    python benchmarks/decode_sweep.py --v-layout-ab    # V blocks key-major vs head_dim-major, ~2 min
    python benchmarks/decode_sweep.py --maxnreg-ab     # the default tiles under register caps (ptxas maxnreg)

Prints one line per config and, last, the best per cache dtype beside the default; --out writes
{"bf16": "block_n,warps,stages", "fp8": ...} for PAGEDLLM_DECODE_CONFIG. With --order-ab,
each of a few tiles runs with the grid in request order and with the requests longest first
(the engine's PAGEDLLM_DECODE_ORDER=1), and the table shows both.

--last-reduce-ab: small batches instead (issue 15): Qwen3-30B-A3B's attention (32 query heads, 4
kv heads) and Llama-3.1-8B's (32, 8), head_dim 128, bf16 cache, batch 1, 2, 4 at contexts of
128-4096 tokens each, the split count from --graph-max-seq-len as a CUDA graph of the engine
takes it; each point timed as decode steps run (a CUDA graph of LAYERS calls, each on its own
cache, replayed) with the reduce kernel and with the last split merging the splits
(PAGEDLLM_DECODE_LAST_REDUCE=1), the merge reading 4, 8 and 16 splits a round (MERGE_UNROLL);
the outputs checked equal to a bf16 ulp first.

The FP8 cache is in the engine's layout, V blocks stored key-major (attention/backend.py).
--v-layout-ab: each cache dtype with V blocks key-major ("-vt") and head_dim-major ("-hd"; FP8's
layout before, bf16's now), a few tiles each, the table showing both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels_bench import paged_batch  # noqa: E402
from pagedllm.attention.backend import key_major_view, v_cache_view  # noqa: E402
from pagedllm.attention.torch_backend import paged_attention_torch  # noqa: E402
from pagedllm.kernels._triton import num_sms  # noqa: E402
from pagedllm.kernels.attention_decode import (  # noqa: E402
    decode_attention_triton,
    decode_config,
    decode_num_splits,
)

HQ, HKV, HD, BS = 16, 8, 128, 16
FP8 = torch.float8_e4m3fn


LAST_REDUCE_MODELS = {"qwen3moe": (32, 4), "llama8b": (32, 8)}
LAYERS = 8


def last_reduce_ab(graph_max_seq_len: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"# decode, reduce kernel vs last split: bf16 cache, D={HD} bs={BS}, {LAYERS} layers a graph, "
          f"splits from max_seq_len {graph_max_seq_len}; us per layer", flush=True)
    unrolls = (4, 8, 16)  # splits the merge reads a round (attention_merge.MERGE_UNROLL: 8)
    print(f"{'model':9s} {'batch':>5s} {'context':>7s} {'splits':>6s} {'kernel':>8s} "
          + " ".join(f"{'last u' + str(u):>9s}" for u in unrolls) + "  best last/kernel")
    for model, (hq, hkv) in LAST_REDUCE_MODELS.items():
        for b, ctx in itertools.product((1, 2, 4), (128, 512, 1024, 2048, 4096)):
            batch, nb = paged_batch([1] * b, [ctx] * b, b, BS, "cuda", gen)
            q = torch.randn(b, hq, HD, device="cuda", dtype=torch.bfloat16)
            caches = [(torch.randn(nb, BS, hkv, HD, device="cuda", dtype=torch.bfloat16),
                       torch.randn(nb, BS, hkv, HD, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
            outs = [torch.empty_like(q) for _ in range(LAYERS)]

            def step(unroll, caches=caches, outs=outs, q=q, batch=batch):  # unroll 0: the reduce kernel
                for (kc, vc), out in zip(caches, outs):
                    decode_attention_triton(q, kc, vc, batch.block_tables, batch.seq_lens, out, HD**-0.5,
                                            max_seq_len=graph_max_seq_len, last_reduce=unroll > 0,
                                            merge_unroll=unroll or None)  # fmt: skip
                return outs[0]

            kernel_out = step(0).clone()
            for u in unrolls:
                err = (step(u).float() - kernel_out.float()).abs().max().item()
                bound = 1.6e-2 * max(kernel_out.float().abs().max().item(), 1.0)
                assert err <= bound, f"{model} b={b} {ctx} u{u}: {err}"
            t = {u: common.graph_time(lambda u=u: step(u), LAYERS, reps=20, rounds=3) for u in (0, *unrolls)}
            splits = decode_num_splits(b, hkv, graph_max_seq_len, num_sms(0))
            best = min(unrolls, key=t.get)
            rows.append({"model": model, "batch": b, "context": ctx, "splits": splits, "kernel_us": t[0],
                         "last_us": t[4], **{f"last_u{u}_us": t[u] for u in unrolls}})  # fmt: skip
            print(f"{model:9s} {b:5d} {ctx:7d} {splits:6d} {t[0]:8.2f} " + " ".join(f"{t[u]:9.2f}" for u in unrolls)
                  + f"  u{best} x{t[best] / t[0]:.3f}", flush=True)  # fmt: skip
            del caches, outs
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--graph-max-seq-len", type=int, default=4096, help="the bound the split count is taken from")
    ap.add_argument("--order-ab", action="store_true", help="a few tiles, each in request order and longest first")
    ap.add_argument("--v-layout-ab", action="store_true",
                    help="a few tiles, V blocks key-major and head_dim-major, bf16 and FP8 caches")
    ap.add_argument("--maxnreg-ab", action="store_true",
                    help="the default tiles, longest first, under register caps of 128-88 (ptxas maxnreg)")
    ap.add_argument("--last-reduce-ab", action="store_true",
                    help="batch 1-4, contexts 128-4096: reduce kernel vs the last split's merge")
    args = ap.parse_args()
    import triton.testing

    if args.last_reduce_ab:
        rows = last_reduce_ab(args.graph_max_seq_len)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return

    rng = random.Random(0)
    b = args.batch
    loads = {"w1-mix": [rng.randint(100, 2048) for _ in range(b)], "1024": [1024] * b}
    if args.order_ab:  # W1 300 steps in: prompts of 100-1024 plus 300 generated tokens
        loads["w1-t300"] = [rng.randint(100, 1024) + 300 for _ in range(b)]
    gen = torch.Generator().manual_seed(0)
    splits = decode_num_splits(b, HKV, args.graph_max_seq_len, num_sms(0))
    print(f"# decode sweep: B={b}, Hq={HQ} Hkv={HKV} D={HD} bs={BS}, splits={splits}", flush=True)
    best: dict[str, tuple[float, tuple[int, int, int]]] = {}
    table = []
    caches = ("bf16-hd", "bf16-vt", "fp8-hd", "fp8-vt") if args.v_layout_ab else ("bf16", "fp8")
    for cache in caches:
        fp8 = cache.startswith("fp8")
        default = decode_config(1 if fp8 else 2)[:3]
        for load, seq_lens in loads.items():
            batch, nb = paged_batch([1] * b, seq_lens, b, BS, "cuda", gen)
            q = torch.randn(b, HQ, HD, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(nb, BS, HKV, HD, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            k_scale = v_scale = 1.0
            if fp8:
                k_scale = v_scale = 0.02
                kc, vc = (kc / k_scale).to(FP8), (vc / v_scale).to(FP8)
            ref = paged_attention_torch(q, kc.to(torch.bfloat16) * k_scale if fp8 else kc,
                                        vc.to(torch.bfloat16) * v_scale if fp8 else vc,
                                        batch, HD**-0.5)  # fmt: skip
            if cache.endswith("-vt"):
                vc = key_major_view(torch.empty_like(vc)).copy_(vc)
            elif cache == "fp8":
                vc = v_cache_view(torch.empty_like(vc)).copy_(vc)  # the engine's layout
            out = torch.empty_like(q)
            kv_bytes = 2 * sum(seq_lens) * HKV * HD * kc.element_size()
            results = {}
            configs = list(itertools.product((64, 128, 256), (4, 8), (2, 3, 4)))
            orders = [None]
            if args.order_ab or args.v_layout_ab:
                configs = list(dict.fromkeys([default, (64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 4, 4),
                                              (128, 8, 3), (256, 8, 3)]))
            if args.maxnreg_ab:  # the default tiles under register caps (a 4th field: maxnreg)
                configs = [default, (*default, 128), (*default, 112), (*default, 104), (*default, 96), (*default, 88)]
                orders = [torch.argsort(batch.seq_lens, descending=True).to(torch.int32)]  # the engine's order
            if args.order_ab:
                orders.append(torch.argsort(batch.seq_lens, descending=True).to(torch.int32))
            for (bn, w, st, *cap), order in itertools.product(configs, orders):
                def run(bn=bn, w=w, st=st, cap=cap, order=order):
                    return decode_attention_triton(q, kc, vc, batch.block_tables, batch.seq_lens, out, HD**-0.5,
                                                   max_seq_len=args.graph_max_seq_len, block_n=bn, num_warps=w,
                                                   num_stages=st, maxnreg=cap[0] if cap else None, k_scale=k_scale,
                                                   v_scale=v_scale, order=order)  # fmt: skip
                try:
                    err = (run().float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                except Exception as exc:  # out of shared memory / registers
                    print(f"{cache} {load} bn={bn} w={w} st={st}: {type(exc).__name__}", flush=True)
                    continue
                ok = err < 0.05
                key = (bn, w, st, *cap) + (("longest first",) if order is not None and not args.maxnreg_ab else ())
                results[key] = ms if ok else float("inf")
                tag = " longest first" if order is not None else ""
                tag += f" maxnreg={cap[0]}" if cap else ""
                print(f"{cache} {load:7s} bn={bn:<3} w={w} st={st}{tag}: {ms * 1e3:8.1f} us "
                      f"{kv_bytes / ms / 1e9:6.2f} TB/s err {err:.1e}{'' if ok else '  WRONG'}",
                      flush=True)  # fmt: skip
            cfg = min(results, key=results.get)
            table.append((cache, load, default, results.get(default, float("nan")), cfg, results[cfg], kv_bytes))
            if load == "w1-mix" and len(cfg) == 3 and cache in ("bf16", "fp8"):
                best[cache] = (results[cfg], cfg)
    print("\n=== decode kernel, us (TB/s) ===")
    for cache, load, d, dms, cfg, ms, nbytes in table:
        print(f"{cache:5s} {load:7s} default {d}: {dms * 1e3:7.1f} ({nbytes / dms / 1e9:4.2f})   best {cfg}: "
              f"{ms * 1e3:7.1f} ({nbytes / ms / 1e9:4.2f})")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({c: ",".join(map(str, cfg)) for c, (_, cfg) in best.items()}))


if __name__ == "__main__":
    main()
