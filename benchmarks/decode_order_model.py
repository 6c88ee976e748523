"""A fluid model of the decode grid's tail (no GPU): why the longest-first program order
(PAGEDLLM_DECODE_ORDER) may pay. The programs of one decode step (one per request and kv head,
work = the request's context length) start in grid order into `slots` resident places; the
active ones share the memory bandwidth equally, but each can draw at most 1/`sat` of it (it
takes `sat` programs to saturate HBM). Prints the makespan over the ideal (all bytes at full
bandwidth) for the request-order grid, longest-first with all kv heads of a request together
(what the engine does), and longest-first per kv head, at W1's contexts `t` steps in.

    python benchmarks/decode_order_model.py [--slots 660] [--sat 200 400]

A model, not a measurement: benchmarks/decode_sweep.py --order-ab measures the kernel.
"""

from __future__ import annotations

import argparse
import random


def makespan(work: list[float], slots: int, sat: int) -> float:
    t, active, i = 0.0, [], 0
    while i < len(work) or active:
        while len(active) < slots and i < len(work):
            active.append(work[i])
            i += 1
        rate = min(1.0 / len(active), 1.0 / sat)
        m = min(active)
        t += m / rate
        active = [a - m for a in active if a - m > 1e-9]
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=660, help="resident programs (132 SMs x 5 at 96 registers)")
    p.add_argument("--sat", type=int, nargs="+", default=[200, 400])
    p.add_argument("--kv-heads", type=int, default=8)
    args = p.parse_args()
    rng = random.Random(0)
    for t in (50, 300, 600):
        prompts = [rng.randint(100, 1024) for _ in range(256)]
        outs = [rng.randint(100, 1024) for _ in range(256)]
        lens = [float(pl + t) for pl, o in zip(prompts, outs) if o > t]
        desc = sorted(lens, reverse=True)
        grids = {
            "request order": [n for _ in range(args.kv_heads) for n in lens],
            "longest first, heads together": [n for n in desc for _ in range(args.kv_heads)],
            "longest first per head": [n for _ in range(args.kv_heads) for n in desc],
        }
        ideal = sum(grids["request order"])
        for sat in args.sat:
            cells = ", ".join(f"{k} {makespan(g, args.slots, sat) / ideal:.3f}" for k, g in grids.items())
            print(f"t={t:<4} {len(lens):>3} requests, sat={sat}: makespan / ideal: {cells}")


if __name__ == "__main__":
    main()
