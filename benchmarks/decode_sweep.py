"""The paged decode kernels' tiles at W1's shape, bf16 and FP8 caches (issues 13 and 14): each
(BLOCK_N, num_warps, num_stages) checked against the torch reference and timed with
triton.testing.do_bench (median). Qwen3-0.6B's attention (16 query heads, 8 kv heads, head_dim
128), block size 16, 256 requests with W1's context lengths (100-1024 prompt + up to 1024
generated: uniform 100-2048 here) and with 1,024 each; the split count is the engine's
(decode_num_splits with the CUDA graphs' max_seq_len bound).

    python benchmarks/decode_sweep.py [--out best.json]
    python benchmarks/decode_sweep.py --order-ab       # longest-first program order, a few tiles

Prints one line per config and, last, the best per cache dtype beside the default; --out writes
{"bf16": "block_n,warps,stages", "fp8": ...} for PAGEDLLM_DECODE_CONFIG. With --order-ab,
each of a few tiles runs with the grid in request order and with the requests longest first
(the engine's PAGEDLLM_DECODE_ORDER=1), and the table shows both.
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
from pagedllm.attention.torch_backend import paged_attention_torch  # noqa: E402
from pagedllm.kernels.attention_decode import (  # noqa: E402
    _num_sms,
    decode_attention_triton,
    decode_config,
    decode_num_splits,
)

HQ, HKV, HD, BS = 16, 8, 128, 16
FP8 = torch.float8_e4m3fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--graph-max-seq-len", type=int, default=4096, help="the bound the split count is taken from")
    ap.add_argument("--order-ab", action="store_true", help="a few tiles, each in request order and longest first")
    args = ap.parse_args()
    import triton.testing

    rng = random.Random(0)
    b = args.batch
    loads = {"w1-mix": [rng.randint(100, 2048) for _ in range(b)], "1024": [1024] * b}
    if args.order_ab:  # W1 300 steps in: prompts of 100-1024 plus 300 generated tokens
        loads["w1-t300"] = [rng.randint(100, 1024) + 300 for _ in range(b)]
    gen = torch.Generator().manual_seed(0)
    splits = decode_num_splits(b, HKV, args.graph_max_seq_len, _num_sms(0))
    print(f"# decode sweep: B={b}, Hq={HQ} Hkv={HKV} D={HD} bs={BS}, splits={splits}", flush=True)
    best: dict[str, tuple[float, tuple[int, int, int]]] = {}
    table = []
    for cache in ("bf16", "fp8"):
        default = decode_config(1 if cache == "fp8" else 2)
        for load, seq_lens in loads.items():
            batch, nb = paged_batch([1] * b, seq_lens, b, BS, "cuda", gen)
            q = torch.randn(b, HQ, HD, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(nb, BS, HKV, HD, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            k_scale = v_scale = 1.0
            if cache == "fp8":
                k_scale = v_scale = 0.02
                kc, vc = (kc / k_scale).to(FP8), (vc / v_scale).to(FP8)
            ref = paged_attention_torch(q, kc.to(torch.bfloat16) * k_scale if cache == "fp8" else kc,
                                        vc.to(torch.bfloat16) * v_scale if cache == "fp8" else vc,
                                        batch, HD**-0.5)  # fmt: skip
            out = torch.empty_like(q)
            kv_bytes = 2 * sum(seq_lens) * HKV * HD * kc.element_size()
            results = {}
            configs = list(itertools.product((64, 128, 256), (4, 8), (2, 3, 4)))
            orders = [None]
            if args.order_ab:
                configs = list(dict.fromkeys([default, (64, 4, 3), (64, 4, 4), (128, 4, 3)]))
                orders.append(torch.argsort(batch.seq_lens, descending=True).to(torch.int32))
            for (bn, w, st), order in itertools.product(configs, orders):
                def run(bn=bn, w=w, st=st, order=order):
                    return decode_attention_triton(q, kc, vc, batch.block_tables, batch.seq_lens, out, HD**-0.5,
                                                   max_seq_len=args.graph_max_seq_len, block_n=bn, num_warps=w,
                                                   num_stages=st, k_scale=k_scale,
                                                   v_scale=v_scale, order=order)  # fmt: skip
                try:
                    err = (run().float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                except Exception as exc:  # out of shared memory / registers
                    print(f"{cache} {load} bn={bn} w={w} st={st}: {type(exc).__name__}", flush=True)
                    continue
                ok = err < 0.05
                key = (bn, w, st) + (("longest first",) if order is not None else ())
                results[key] = ms if ok else float("inf")
                tag = " longest first" if order is not None else ""
                print(f"{cache} {load:7s} bn={bn:<3} w={w} st={st}{tag}: {ms * 1e3:8.1f} us "
                      f"{kv_bytes / ms / 1e9:6.2f} TB/s err {err:.1e}{'' if ok else '  WRONG'}",
                      flush=True)  # fmt: skip
            cfg = min(results, key=results.get)
            table.append((cache, load, default, results.get(default, float("nan")), cfg, results[cfg], kv_bytes))
            if load == "w1-mix" and len(cfg) == 3:
                best[cache] = (results[cfg], cfg)
    print("\n=== decode kernel, us (TB/s) ===")
    for cache, load, d, dms, cfg, ms, nbytes in table:
        print(f"{cache:5s} {load:7s} default {d}: {dms * 1e3:7.1f} ({nbytes / dms / 1e9:4.2f})   best {cfg}: "
              f"{ms * 1e3:7.1f} ({nbytes / ms / 1e9:4.2f})")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({c: ",".join(map(str, cfg)) for c, (_, cfg) in best.items()}))


if __name__ == "__main__":
    main()
