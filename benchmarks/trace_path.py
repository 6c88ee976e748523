"""What each kernel adds to a step's wall time when kernels overlap (PDL): reads a Chrome trace written by
`profile_gpu.py --trace`, takes the GPU kernels in start order, cuts them into steps where the device sat
idle longer than --step-gap us, and charges each kernel the time by which it moved the step's latest end
forward ("exposed"), the GPU's idle time before it ("idle"), and how far it started before the kernels
before it had ended ("early", what PDL bought it). A kernel is named with the kernels before and after
it (a layer's q/k/v, o and router GEMMs are one kernel in three places). Exposed + idle over a step's
kernels is the step's span; the time between steps is the host's.

    python3 benchmarks/trace_path.py trace.json [--top 30] [--step-gap 20] [--step-last REGEX]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict


def short(name: str) -> str:
    """A kernel's name without its template arguments and signature."""
    name = re.sub(r"<.*", "", name.split("(")[0]).replace("void ", "")
    return name.rsplit("::", 1)[-1][:40]


def kernels(trace: dict) -> list[tuple[float, float, str, str]]:
    """(start us, end us, short name, "grid / threads a block, registers, occupancy") of the trace's GPU
    kernels, by start. The occupancy is the profiler's estimate (warps resident an SM over the most it
    holds): with the grid and registers it tells a kernel whose programs do not all fit at once."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            a = e.get("args", {})
            grid = "x".join(str(g) for g in a.get("grid", [])) or "?"
            threads = math.prod(a.get("block", [])) if a.get("block") else "?"
            occupancy = a.get("est. achieved occupancy %")
            launch = f"{grid}/{threads} r{a.get('registers per thread', '?')}"
            if occupancy is not None:
                launch += f" occ{occupancy}"
            out.append((e["ts"], e["ts"] + e.get("dur", 0), short(e["name"]), launch))
    return sorted(out)


def steps(ks: list[tuple], gap: float, last: str | None = None) -> list[list[tuple]]:
    """Cut the kernels where the device was idle more than gap us (between graph replays), and after
    each kernel whose name matches `last` (a step's last kernel, where the host's next launch
    arrives before the device is idle)."""
    out: list[list] = []
    end = float("-inf")
    cut = True
    for k in ks:
        if cut or k[0] - end > gap:
            out.append([])
        out[-1].append(k)
        end = max(end, k[1])
        cut = last is not None and re.search(last, k[2]) is not None
    return out


def charge(step: list[tuple]) -> list[tuple[str, float, float, float, float]]:
    """(context name, duration, exposed, idle, early) for each kernel of a step."""
    rows = []
    latest = step[0][0]
    for i, (s, e, name, launch) in enumerate(step):
        before = step[i - 1][2] if i else "^"
        ctx = f"{before} > {name} > {step[i + 1][2] if i + 1 < len(step) else '$'} [{launch}]"
        rows.append((ctx, e - s, max(0.0, e - max(latest, s)), max(0.0, s - latest), max(0.0, latest - s)))
        latest = max(latest, e)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--step-gap", type=float, default=20.0, help="idle us that separates two steps")
    ap.add_argument("--step-last", default=r"^_sample_reduce_kernel$|^reduce_kernel$",
                    help="a regex of the kernel names that end a step (the sampler's)")  # fmt: skip
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        ks = kernels(json.load(f))
    if not ks:
        raise SystemExit(f"{args.trace}: no GPU kernels in the trace")
    cut = [s for s in steps(ks, args.step_gap, args.step_last) if len(s) > 1]
    # the window's most common kernel count a step: the decode steps (a prefill or a warm-up step differs)
    common_len = statistics.mode(len(s) for s in cut)
    decode = [s for s in cut if len(s) == common_len]
    spans = [max(k[1] for k in s) - s[0][0] for s in decode]
    between = [b[0][0] - max(k[1] for k in a) for a, b in zip(cut, cut[1:])]
    print(f"{len(decode)} steps of {common_len} kernels (of {len(cut)}, cut at {args.step_gap:g} us idle and after "
          f"--step-last): span {statistics.median(spans):.1f} us a step (median); host between steps "
          f"{statistics.median(between):.1f} us")
    acc: dict[str, list[list[float]]] = defaultdict(lambda: [[], [], [], []])
    for s in decode:
        for ctx, dur, exp, idle, early in charge(s):
            for lst, v in zip(acc[ctx], (dur, exp, idle, early)):
                lst.append(v)
    n = len(decode)
    total = {k: sum(v[1]) / n + sum(v[2]) / n for k, v in acc.items()}
    head = "kernel (before > it > after) [grid/threads, registers, occupancy %]"
    print(f"\n{head:<110} {'/step':>6} {'dur us':>7} {'exposed':>8} {'idle':>6} {'early':>6} {'us/step':>8}")
    for k in sorted(total, key=lambda k: -total[k])[: args.top]:
        dur, exp, idle, early = (statistics.mean(v) for v in acc[k])
        print(f"{k[:110]:<110} {len(acc[k][0]) / n:>6.1f} {dur:>7.2f} {exp:>8.2f} {idle:>6.2f} {early:>6.2f} "
              f"{total[k]:>8.1f}")  # fmt: skip
    print(f"{'sum of exposed + idle (= span)':<110} {sum(total.values()):>47.1f}")


if __name__ == "__main__":
    main()
