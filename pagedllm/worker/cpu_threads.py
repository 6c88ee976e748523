"""The CPU worker's intra-op thread count, step by step: the cores that other processes leave free.

A decode step of a small model is several hundred OpenMP parallel regions (each projection,
norm, rotary, attention call), and every region waits for all of its threads. When other
processes share the cores, one of our threads is often off its core for a scheduler slice
(milliseconds) while the other waits at the region's end: on the 2-core machine, with the load
average at 7-9 from other work, W4 ran at 3.0 tok/s on two threads and 16.9 tok/s on one
(benchmarks/RESULTS.md). On a quiet machine two threads are faster.

So, at most every `window` seconds, the worker reads how much CPU time the machine spent busy
(/proc/stat) and how much of it was this process's own (`time.process_time`, all its threads),
and runs the next steps on max(1, cores - round(others' cores)) threads, capped at the count
it started with (torch's, which OMP_NUM_THREADS / torch.set_num_threads set). Thread counts
only change how work is split, never the result's math in pagedllm's kernels, and MKL's GEMMs
split the output, not the sum. `PAGEDLLM_CPU_ADAPTIVE_THREADS=0` keeps the count fixed.
"""

from __future__ import annotations

import os
import time

import torch


def enabled() -> bool:
    return os.environ.get("PAGEDLLM_CPU_ADAPTIVE_THREADS", "1").strip().lower() not in ("0", "false", "no", "off")


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes spent busy since boot, from /proc/stat's first line (None where
    there is none)."""
    try:
        with open("/proc/stat", "rb") as fh:
            fields = fh.readline().split()[1:9]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ThreadGovernor:
    def __init__(self, window: float = 0.5):
        self.max_threads = torch.get_num_threads()
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.window = window
        self.threads = self.max_threads
        self._mark = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        return time.monotonic(), machine_busy_seconds(), time.process_time()

    def active(self) -> bool:
        return self.max_threads > 1 and self._mark[1] is not None

    def before_step(self) -> int:
        """Sets torch's thread count for the coming step; returns it."""
        now = time.monotonic()
        if now - self._mark[0] < self.window:
            return self.threads
        t1, busy1, own1 = self._sample()
        t0, busy0, own0 = self._mark
        self._mark = (t1, busy1, own1)
        if busy0 is None or busy1 is None:  # no /proc/stat: keep the count
            return self.threads
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)  # cores other processes kept busy
        threads = max(1, min(self.max_threads, self.cores - int(others + 0.5)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
