"""The figures of a benchmarks/serve.py run, from its requests' timings (serve.RequestResult):
goodput SLOs, TTFT / TPOT / ITL / E2E statistics, throughput, peak concurrency, the per-second
timelines the plot draws, the printed report (the layout of `vllm bench serve`), and how busy
the host's CPUs were meanwhile (client, server and everything else, from /proc)."""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from serve import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")


def cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0.0), sum(fields)


def _process_cpu(pid: int | str) -> float | None:
    """CPU time (user + system, all threads) a process has used, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return float(fields[11]) + float(fields[12])  # utime, stime


def cpu_snapshot(server_pid: int | None) -> dict[str, float | None] | None:
    times = cpu_times()
    if times is None:
        return None
    return {"idle": times[0], "total": times[1], "self": _process_cpu("self"),
            "server": _process_cpu(server_pid) if server_pid else None}


def cpu_report(before: dict | None, after: dict | None, duration: float) -> dict[str, float | None]:
    """How busy the host was during the run, in cores on average: all of it, this client, the
    server (with --server-pid) and the rest, that is whatever else shared the machine."""
    if not before or not after or duration <= 0:
        return {}
    ticks = os.sysconf("SC_CLK_TCK")
    busy = ((after["total"] - before["total"]) - (after["idle"] - before["idle"])) / ticks / duration
    client = (after["self"] - before["self"]) / ticks / duration if before["self"] is not None else None
    server = None
    if before["server"] is not None and after["server"] is not None:
        server = (after["server"] - before["server"]) / ticks / duration
    other = busy - (client or 0.0) - (server or 0.0) if server is not None else None
    return {"host_busy_cores": busy, "client_cores": client, "server_cores": server, "other_cores": other}


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise SystemExit(f"--goodput: {name!r} is not one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise SystemExit(f"--goodput: expected NAME:MILLISECONDS, got {item!r}") from None
        if ms <= 0:
            raise SystemExit(f"--goodput: the SLO must be > 0 ms, got {item!r}")
        slos[name] = ms / 1000.0
    return slos


def summarize(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """Mean, median, std and percentiles in milliseconds (zeros when there is nothing)."""
    a = np.asarray(values or [0.0]) * 1000.0
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def compute_metrics(results: list[RequestResult], duration: float, slos: dict[str, float],
                    percentiles: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    tpots = {id(r): (r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1}
    good = sum(
        1 for r in ok
        if r.ttft <= slos.get("ttft", math.inf)
        and tpots.get(id(r), 0.0) <= slos.get("tpot", math.inf)
        and r.latency <= slos.get("e2el", math.inf)
    )
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_second, concurrency = timelines(ok, duration)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": float(per_second.max()) if len(per_second) else 0.0,
        "max_concurrent_requests": peak_concurrency(ok),
        "ttft_ms": summarize([r.ttft for r in ok], percentiles),
        "tpot_ms": summarize(list(tpots.values()), percentiles),
        "itl_ms": summarize([x for r in ok for x in r.itl], percentiles),
        "e2el_ms": summarize([r.latency for r in ok], percentiles),
    }


def peak_concurrency(ok: list[RequestResult]) -> int:
    """The most requests in flight at one moment (intervals [start, end): an end before a start
    at the same instant)."""
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def timelines(ok: list[RequestResult], duration: float) -> tuple[np.ndarray, np.ndarray]:
    """Output chunks per one-second window, and requests in flight sampled every 0.1 s. A chunk
    is counted as one token: the server sends one per token unless text is held back."""
    seconds = int(math.ceil(duration)) + 1
    per_second = np.zeros(seconds)
    for r in ok:
        for t in r.chunk_times:
            per_second[min(int(t), seconds - 1)] += 1
    grid = np.arange(0.0, duration + 0.1, 0.1)
    concurrency = np.zeros(len(grid))
    for r in ok:
        concurrency += (grid >= r.start) & (grid < r.start + r.latency)
    return per_second, concurrency


def print_report(args: argparse.Namespace, m: dict[str, Any], slos: dict[str, float]) -> None:
    line = "=" * 60

    def row(name: str, value: Any) -> None:
        print(f"{name:<42}{value:>18}")

    print(line)
    print(f"{' Serving Benchmark Result ':=^60}")
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Request rate (req/s):", f"{args.request_rate:g}")
    row("Burstiness:", f"{args.burstiness:g}")
    row("Max concurrency:", args.max_concurrency or "none")
    row("Benchmark duration (s):", f"{m['duration_s']:.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", f"{m['request_throughput']:.2f}")
    if slos:
        row("Request goodput (req/s):", f"{m['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")
    row("Peak output tokens/s (1 s windows):", f"{m['max_output_tokens_per_s']:.0f}")
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    names = {"host_busy_cores": "Host CPU busy (cores):", "client_cores": "  of which this client:",
             "server_cores": "  of which the server:", "other_cores": "  of which other processes:"}
    for key, name in names.items():
        if args.cpu.get(key) is not None:
            row(name, f"{args.cpu[key]:.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^60}")
        short = key.split("_")[0].upper()
        for stat, value in m[key].items():
            if stat == "std":
                continue
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{label} {short} (ms):", f"{value:.2f}")
    print(line)
