"""The PNG of a benchmarks/serve.py run: TTFT, TPOT, ITL and E2E distributions, and output
tokens/s and requests in flight over time. Needs matplotlib (imported only here)."""

from __future__ import annotations

from typing import Any

import numpy as np


def plot(path: str, results: list, m: dict[str, Any], duration: float, title: str,
         per_second: np.ndarray, concurrency: np.ndarray) -> None:
    """results: serve.RequestResult; per_second / concurrency: serve_metrics.timelines(ok, duration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft * 1000 for r in ok],
        "TPOT": [(r.latency - r.ttft) / (r.output_len - 1) * 1000 for r in ok if r.output_len > 1],
        "ITL": [x * 1000 for r in ok for x in r.itl],
        "E2E latency": [r.latency * 1000 for r in ok],
    }
    fig = plt.figure(figsize=(16, 8.5), constrained_layout=True)
    grid = fig.add_gridspec(2, 4)
    for col, (name, values) in enumerate(series.items()):
        ax = fig.add_subplot(grid[0, col])
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 4)), color=f"C{col}", alpha=0.85)
            for stat, style in (("mean", "-"), ("median", "--"), ("p99", ":")):
                key = {"TTFT": "ttft_ms", "TPOT": "tpot_ms", "ITL": "itl_ms", "E2E latency": "e2el_ms"}[name]
                if stat in m[key]:
                    ax.axvline(m[key][stat], color="k", linestyle=style, linewidth=1,
                               label=f"{stat} {m[key][stat]:.0f} ms")
            ax.legend(fontsize=8)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("requests" if name != "ITL" else "gaps")
    ax = fig.add_subplot(grid[1, :])
    ax.bar(np.arange(len(per_second)) + 0.5, per_second, width=1.0, color="C0", alpha=0.6,
           label="output tokens/s (1 s windows)")
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(np.arange(len(concurrency)) * 0.1, concurrency, color="C3", label="requests in flight")
    ax2.set_ylabel("requests in flight")
    starts = [r.start for r in results]
    ax2.plot(starts, np.zeros(len(starts)), "|", color="k", markersize=12, label="request sent")
    ax.set_xlim(0, max(duration, 1.0))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    ax.set_title(f"throughput over time: {m['output_throughput']:.1f} output tok/s, "
                 f"{m['request_throughput']:.2f} req/s, {m['completed']} ok / {m['failed']} failed")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
