"""The router's overhead per request on loopback: the same requests sent straight to a backend
and through `pagedllm router` in front of it, interleaved in one run (a direct request, then a
routed one, ...), at a fixed rate; the added latency is the routed P50 (P90, P99) minus the
direct one. The backend answers at once, so what is measured is HTTP and routing, not
generation: `--backend stub` (default) is a trivial HTTP/1.1 server in its own process that
returns a fixed completion (on a 2-core machine a real server's own queueing would swamp the
router's share), `--backend pagedllm` a real pagedllm server of a tiny random Llama answering
max_tokens=1.

    .venv/bin/python benchmarks/router_overhead.py --rate 100 --num-requests 2000
    .venv/bin/python benchmarks/router_overhead.py --backend pagedllm --rate 50

Starts the backend and the router itself (subprocesses on free ports), or uses --backend-url /
--router-url for ones already running.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(out_dir: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import save_tiny_model, tiny_config  # the tests' tiny random Llama
    from transformers import AutoTokenizer

    from pagedllm.config import default_model_path

    d, f = os.path.split(default_model_path())
    tok_dir = os.path.join(out_dir, "tokenizer")
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tok_dir)
    return save_tiny_model(tiny_config("llama"), os.path.join(out_dir, "model"), tok_dir)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready")


_STUB_COMPLETION = (b'{"id":"cmpl-stub","object":"text_completion","created":0,"model":"tiny","choices":'
                    b'[{"index":0,"text":" hi","logprobs":null,"finish_reason":"length"}],'
                    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')


def serve_stub(port: int) -> None:
    """A trivial OpenAI-shaped backend: every POST gets the fixed completion, GET /health 200,
    GET /metrics an empty exposition; HTTP/1.1 keep-alive, nothing else."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                body = _STUB_COMPLETION if head.startswith(b"POST") else b""
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def _run(direct: str, routed: str, model: str, rate: float, n: int, warmup: int) -> dict[str, list[float]]:
    import httpx

    body = {"model": model, "prompt": "Hello, router", "max_tokens": 1, "temperature": 0}
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        async def one(kind: str, url: str, record: bool) -> None:
            t0 = time.perf_counter()
            try:
                r = await client.post(url + "/v1/completions", json=body)
            except Exception as e:
                raise RuntimeError(f"{kind} request {url}: {e!r}") from e
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(f"{kind}: {r.status_code} {r.text[:200]}")
            if record:
                lat[kind].append(dt * 1000)

        tasks = []
        start = time.perf_counter()
        for i in range(warmup + n):
            # Fixed spacing at `rate` req/s overall; direct and routed alternate (and swap order
            # every other pair, so neither always goes first).
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            kind = ("direct", "router")[(i + (i // 2)) % 2]
            tasks.append(asyncio.ensure_future(one(kind, direct if kind == "direct" else routed, i >= warmup)))
        await asyncio.gather(*tasks)
    return lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=100.0, help="Requests per second, direct and routed together.")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--backend-url", default=None)
    p.add_argument("--router-url", default=None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--backend", choices=("stub", "pagedllm"), default="stub")
    p.add_argument("--serve-stub", type=int, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.serve_stub is not None:
        serve_stub(ns.serve_stub)
        return 0
    procs: list[subprocess.Popen] = []
    tmp = tempfile.TemporaryDirectory()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        backend = ns.backend_url
        if backend is None and ns.backend == "stub":
            port = _free_port()
            backend = f"http://127.0.0.1:{port}"
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve-stub", str(port)], env=env))
            _wait(backend, procs[-1])
        if backend is None:
            model_dir = _tiny_model(tmp.name)
            port = _free_port()
            backend = f"http://127.0.0.1:{port}"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pagedllm.entrypoints.openai_api_server", "--model", model_dir, "--port",
                 str(port), "--served-model-name", ns.model, "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                 "--disable-log-stats", "--disable-uvicorn-access-log", "--log-level", "warning"], env=env))
            _wait(backend, procs[-1])
        router = ns.router_url
        if router is None:
            port = _free_port()
            router = f"http://127.0.0.1:{port}"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--port", str(port),
                 "--backend", f"t={backend}={ns.model}", "--log-level", "warning"], env=env))
            _wait(router, procs[-1])
        lat = asyncio.run(_run(backend, router, ns.model, ns.rate, ns.num_requests, ns.warmup))
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        tmp.cleanup()
    d, r = lat["direct"], lat["router"]
    what = "a stub backend" if ns.backend == "stub" and ns.backend_url is None else "a pagedllm backend, max_tokens=1"
    print(f"{len(d)} direct + {len(r)} routed requests at {ns.rate:g} req/s ({what}, loopback)")
    print(f"{'':8}{'P50 ms':>9}{'P90 ms':>9}{'P99 ms':>9}{'mean ms':>9}")
    for name, xs in (("direct", d), ("router", r)):
        print(f"{name:8}{_pct(xs, .5):>9.2f}{_pct(xs, .9):>9.2f}{_pct(xs, .99):>9.2f}{statistics.mean(xs):>9.2f}")
    print(f"{'added':8}{_pct(r, .5) - _pct(d, .5):>9.2f}{_pct(r, .9) - _pct(d, .9):>9.2f}"
          f"{_pct(r, .99) - _pct(d, .99):>9.2f}{statistics.mean(r) - statistics.mean(d):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
