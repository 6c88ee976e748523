"""Resident memory of `pagedllm serve` with the embedded model: the server's process tree
(VmRSS summed) once it is ready and again after a few chat requests, for each set of serve
options given, one server at a time.

    python benchmarks/serve_memory.py "" "--quantization none"
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _tree_rss(pid: int) -> int:
    """VmRSS of pid and its descendants, in bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(options: str) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port), *shlex.split(options)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"server with {options!r} did not start") from None
                time.sleep(1)
        ready = _tree_rss(proc.pid)
        body = json.dumps({"model": json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"],
                           "messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 64, "temperature": 0}).encode()
        for _ in range(4):
            req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            answer = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]["content"]
        return {"options": options, "ready_rss": ready, "after_rss": _tree_rss(proc.pid), "answer": answer}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    runs = [measure(o) for o in (sys.argv[1:] or [""])]
    for r in runs:
        print(f"serve {r['options'] or '(defaults)'}: RSS ready {r['ready_rss'] / 2**20:.0f} MiB, after 4 chats "
              f"{r['after_rss'] / 2**20:.0f} MiB; answer {r['answer'][:60]!r}")
    common.print_machine_line(common.machine_info())


if __name__ == "__main__":
    main()
