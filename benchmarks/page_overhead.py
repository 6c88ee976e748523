"""Does an open engine page slow the engine? W4 through the real server, with and without a page's
traffic (the /ui/events snapshot stream and a /metrics poll every 2 s, as the page does),
alternated round by round in one server process; medians and the ratio.

    python benchmarks/page_overhead.py --rounds 4 --output-json /tmp/page.json

W4 here: SmolLM2-135M-Instruct (the embedded GGUF, float32), the 32 chat prompts of
benchmarks/throughput.py sent at once, max_tokens uniform in [16, 128] (seeded), greedy,
ignore_eos (so every round produces the same tokens).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from common import machine_info, print_machine_line, source_revision, write_json  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from throughput import W4_QUESTIONS  # noqa: E402


def run_w4(url: str, max_tokens: list[int]) -> tuple[float, int]:
    model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def one(i: int) -> int:
        r = requests.post(url + "/v1/chat/completions", timeout=600, json={
            "model": model, "temperature": 0, "max_tokens": max_tokens[i], "ignore_eos": True,
            "messages": [{"role": "user", "content": W4_QUESTIONS[i]}],
        })
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(max_tokens)) as pool:
        tokens = sum(pool.map(one, range(len(max_tokens))))
    return time.perf_counter() - t0, tokens


class PageTraffic:
    """What an open page fetches: the snapshot stream and /metrics every 2 s."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.snapshots = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self._events, daemon=True),
                        threading.Thread(target=self._metrics, daemon=True)]

    def _events(self) -> None:
        with requests.get(self.url + "/ui/events", stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    self.snapshots += 1
                if self.stop.is_set():
                    return

    def _metrics(self) -> None:
        while not self.stop.wait(2.0):
            requests.get(self.url + "/metrics", timeout=30)

    def __enter__(self) -> "PageTraffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    max_tokens = [rng.randint(16, 128) for _ in W4_QUESTIONS[:32]]
    server = ServerProcess(["--max-model-len", "512", "--disable-log-stats", "--disable-uvicorn-access-log"],
                           "/tmp/page_overhead_server.log")
    server.wait_ready(600)
    try:
        run_w4(server.url, [8] * 4)  # warm-up
        results: dict[str, list[float]] = {"page closed": [], "page open": []}
        snaps = 0
        for r in range(args.rounds):
            order = ["page closed", "page open"] if r % 2 == 0 else ["page open", "page closed"]
            for mode in order:
                if mode == "page open":
                    with PageTraffic(server.url) as page:
                        wall, tokens = run_w4(server.url, max_tokens)
                    snaps += page.snapshots
                else:
                    wall, tokens = run_w4(server.url, max_tokens)
                results[mode].append(tokens / wall)
                print(f"round {r} {mode:12s} {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s", flush=True)
    finally:
        server.stop()
    closed, opened = (statistics.median(results[k]) for k in ("page closed", "page open"))
    machine = machine_info()
    print_machine_line(machine)
    print(f"median output tok/s: page closed {closed:.1f}, page open {opened:.1f} "
          f"(ratio open/closed {opened / closed:.3f}; {snaps} snapshots streamed)")
    write_json(args.output_json, {"machine": machine, "source": source_revision(), "tok_per_s": results,
                                  "median": {"page closed": closed, "page open": opened},
                                  "ratio_open_over_closed": opened / closed, "snapshots": snaps})


if __name__ == "__main__":
    main()
