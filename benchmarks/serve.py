"""Online serving benchmark (W3 of docs/benchmarks.md; the method of `vllm bench serve`):
a streaming client that sends requests to any OpenAI-compatible server and measures what each
user sees.

Requests arrive as a Poisson process at --request-rate (or a gamma process with --burstiness:
below 1 burstier, above 1 more even; `inf` sends them all at once), at most --max-concurrency in
flight. Prompts are random token ids of a given length (sent as token ids to /v1/completions,
exact for any tokenizer; `--prompt-format text` decodes them with --tokenizer instead) or come
from a JSONL file. Every request streams (`stream=true`, usage in the last chunk), and the client
records when each chunk arrives:

    sent ──── TTFT ────▶ chunk 1 ─ ITL ─▶ chunk 2 ─ ITL ─▶ ... ─▶ last chunk
    └──────────────────────────────── E2E latency ──────────────────────┘
    TPOT = (E2E - TTFT) / (output tokens - 1), per request

Reports mean, median, std and percentiles of TTFT, TPOT, ITL and E2E latency; request, output
and total token throughput; goodput (completed requests per second that meet every SLO given
with --goodput); the peak output tokens/s over one-second windows and the peak concurrency.
Writes the figures and every request's timings as JSON, and a PNG (latency distributions,
throughput and concurrency over time; needs matplotlib).

    python -m pagedllm.entrypoints.openai_api_server --port 8000 &        # SmolLM2 on the CPU
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 \\
        --random-input-len 128 --random-output-len 32 --ignore-eos --request-rate 4 \\
        --goodput ttft:2000 tpot:200 --result-json out.json --plot out.png

Only the given URL is contacted. Needs httpx and numpy; transformers only for text prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_metrics import (  # noqa: E402  (this directory is on the path only now)
    compute_metrics,
    cpu_report,
    cpu_snapshot,
    cpu_times,
    parse_goodput,
    print_report,
    timelines,
)


@dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int | None  # None: unknown until the server's usage says
    output_len: int


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the benchmark's start, when the request was sent
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)  # gaps between chunks after the first
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark's start
    prompt_len: int = 0
    output_len: int = 0
    text: str = ""


# ---- prompts ------------------------------------------------------------------------------------------


def random_requests(args: argparse.Namespace, n: int, rng: np.random.Generator, tokenizer: Any) -> list[SampleRequest]:
    """`n` prompts of about --random-input-len random token ids each (lengths uniform within
    +-range-ratio), each asking for about --random-output-len tokens."""

    def lengths(mean: int) -> np.ndarray:
        low = max(1, int(mean * (1 - args.random_range_ratio)))
        high = max(low, int(mean * (1 + args.random_range_ratio)))
        return rng.integers(low, high + 1, size=n)

    in_lens, out_lens = lengths(args.random_input_len), lengths(args.random_output_len)
    low, high = args.random_token_range
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = rng.integers(low, high, size=int(n_in)).tolist()
        if args.prompt_format == "ids":
            out.append(SampleRequest(ids, len(ids), int(n_out)))
        else:
            out.append(SampleRequest(tokenizer.decode(ids), None, int(n_out)))
    return out


def jsonl_requests(args: argparse.Namespace, n: int, rng: np.random.Generator) -> list[SampleRequest]:
    """Lines of {"prompt": text or token ids, "output_len" or "max_tokens": n (optional)};
    `n` of them in a random order, cycling through the file if it is shorter."""
    rows = []
    with open(args.dataset_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row:
                raise SystemExit(f"{args.dataset_path}:{lineno}: no 'prompt' field")
            out_len = int(row.get("output_len", row.get("max_tokens", args.random_output_len)))
            prompt = row["prompt"]
            rows.append(SampleRequest(prompt, len(prompt) if isinstance(prompt, list) else None, out_len))
    if not rows:
        raise SystemExit(f"{args.dataset_path}: no prompts")
    order = rng.permutation(len(rows)).tolist()
    return [rows[order[i % len(rows)]] for i in range(n)]


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: gaps drawn from a gamma distribution of mean
    1 / rate and shape `burstiness` (1: exponential gaps, a Poisson process)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# ---- one request ----------------------------------------------------------------------------------------


def request_body(args: argparse.Namespace, model: str, req: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.chat:
        if not isinstance(req.prompt, str):
            raise SystemExit("the chat endpoint needs text prompts: use --prompt-format text or a text JSONL")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], req: SampleRequest,
               t0: float, chat: bool) -> RequestResult:
    """Stream one request; a chunk that carries text counts as (at least) one token arriving."""
    res = RequestResult(start=time.perf_counter() - t0, prompt_len=req.prompt_len or 0)
    sent = time.perf_counter()
    last = sent
    usage = None
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = ""
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    text += piece or ""
                if not text:
                    continue
                if not res.chunk_times:
                    res.ttft = now - sent
                else:
                    res.itl.append(now - last)
                res.chunk_times.append(now - t0)
                pieces.append(text)
                last = now
        res.latency = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.text = "".join(pieces)
    if usage:
        res.output_len = int(usage.get("completion_tokens") or 0)
        res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
    else:
        res.output_len = len(res.chunk_times)
    if not res.chunk_times:
        res.error = "no tokens came back"
        return res
    res.success = True
    return res


# ---- the run ----------------------------------------------------------------------------------------


def wait_for_quiet(max_wait: float, min_idle: float = 0.85, window_s: float = 5.0, windows: int = 2) -> float | None:
    """On a shared machine (client and server on one host): wait up to `max_wait` seconds until
    the CPUs were at least `min_idle` idle over `windows` windows in a row. Returns the idle
    fraction of the last window (None without /proc/stat)."""
    deadline = time.monotonic() + max_wait
    quiet, idle = 0, None
    while time.monotonic() < deadline:
        before = cpu_times()
        if before is None:
            return None
        time.sleep(window_s)
        after = cpu_times()
        idle = (after[0] - before[0]) / max(after[1] - before[1], 1.0)
        quiet = quiet + 1 if idle >= min_idle else 0
        if quiet >= windows:
            return idle
    print(f"(the machine did not get quiet within {max_wait:.0f} s: idle {idle:.0%}; measuring anyway)",
          file=sys.stderr)
    return idle


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(base_url + "/v1/models")
    r.raise_for_status()
    data = r.json()["data"]
    if not data:
        raise SystemExit(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


async def run(args: argparse.Namespace, warmups: list[SampleRequest],
              requests_: list[SampleRequest]) -> tuple[list[RequestResult], float, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(args.request_timeout, connect=30.0),
                                 limits=limits, trust_env=False) as client:
        model = args.model or await first_model(client, args.base_url)
        url = args.base_url + args.endpoint
        for req in warmups:  # prompts of their own: no prefix-cache hit for a timed request
            warm = await send(client, url, request_body(args, model, req), req, time.perf_counter(), args.chat)
            if not warm.success:
                raise SystemExit(f"the warm-up request failed: {warm.error}")

        rng = np.random.default_rng(args.seed + 1)
        times = arrival_times(len(requests_), args.request_rate, args.burstiness, rng)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        done = 0

        async def one(i: int, req: SampleRequest) -> RequestResult:
            nonlocal done
            delay = t0 + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = request_body(args, model, req)
            if limit is None:
                res = await send(client, url, body, req, t0, args.chat)
            else:
                async with limit:
                    res = await send(client, url, body, req, t0, args.chat)
            done += 1
            if not args.quiet and (done % max(1, len(requests_) // 10) == 0 or done == len(requests_)):
                print(f"  {done}/{len(requests_)} requests done, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            return res

        if args.wait_quiet:
            args.idle_before = wait_for_quiet(args.wait_quiet)
        cpu_before = cpu_snapshot(args.server_pid)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests_)))
        duration = time.perf_counter() - t0
        args.cpu = cpu_report(cpu_before, cpu_snapshot(args.server_pid), duration)
    return list(results), duration, model


# ---- CLI ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's URL, without /v1")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions, or /v1/chat/completions (text prompts only)")
    g.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("PAGEDLLM_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY or $PAGEDLLM_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=("random", "jsonl"), default="random")
    g.add_argument("--dataset-path", default=None, help="the JSONL file, with --dataset-name jsonl")
    g.add_argument("--num-prompts", type=int, default=200)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128,
                   help="max_tokens of each request (and the default for JSONL lines without one)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    g.add_argument("--random-token-range", type=int, nargs=2, default=(0, 10000), metavar=("LOW", "HIGH"),
                   help="random prompt token ids are uniform in [LOW, HIGH)")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="random prompts as token ids (exact lengths) or as text decoded with --tokenizer")
    g.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer dir or a .gguf file, for text prompts")
    g.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps: 1 = Poisson, < 1 burstier, > 1 more even")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    g.add_argument("--num-warmups", type=int, default=1, help="requests sent first and not counted")
    g.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before the timed run, wait up to this long for this host's CPUs to be idle "
                   "(for a server on the same shared machine)")
    g.add_argument("--server-pid", type=int, default=None,
                   help="the server's process id, when it runs on this host: the report then tells "
                   "how much CPU other processes took during the run")
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    g.add_argument("--percentiles", default="90,99", help="comma-separated percentiles to report (beside mean and median)")
    g.add_argument("--result-json", default=None, help="write the figures and per-request timings here")
    g.add_argument("--plot", default=None, help="write a PNG of the distributions and the timeline here")
    g.add_argument("--label", default=None, help="a name for this run in the JSON and the plot")
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (or inf)")
    if not args.burstiness > 0:
        p.error("--burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.dataset_name == "jsonl" and not args.dataset_path:
        p.error("--dataset-name jsonl needs --dataset-path")
    if args.prompt_format == "text" and args.dataset_name == "random" and not args.tokenizer:
        p.error("--prompt-format text needs --tokenizer to turn the random ids into text")
    if not 0 <= args.random_range_ratio < 1:
        p.error("--random-range-ratio must be in [0, 1)")
    args.base_url = args.base_url.rstrip("/")
    args.idle_before = None
    args.cpu = {}
    args.chat = args.endpoint.rstrip("/").endswith("chat/completions")
    return args


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        d, f = os.path.split(path)
        return AutoTokenizer.from_pretrained(d, gguf_file=f)
    return AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    slos = parse_goodput(args.goodput)
    percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    n = args.num_prompts + args.num_warmups
    reqs = random_requests(args, n, rng, tokenizer) if args.dataset_name == "random" else jsonl_requests(args, n, rng)
    if tokenizer is not None:
        for r in reqs:
            if r.prompt_len is None and isinstance(r.prompt, str):
                r.prompt_len = len(tokenizer.encode(r.prompt, add_special_tokens=False))

    results, duration, model = asyncio.run(run(args, reqs[:args.num_warmups], reqs[args.num_warmups:]))
    metrics = compute_metrics(results, duration, slos, percentiles)
    print_report(args, metrics, slos)
    failures = [r.error for r in results if not r.success]
    for err in failures[:5]:
        print(f"failed: {err}", file=sys.stderr)

    label = args.label or f"{model} @ {args.request_rate:g} req/s"
    if args.result_json:
        out = {
            "label": label,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": model,
            "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                       for k, v in vars(args).items() if k != "api_key"},
            "goodput_slo_ms": {k: v * 1000 for k, v in slos.items()},
            "metrics": metrics,
            "requests": [
                {k: v for k, v in asdict(r).items() if k not in ("chunk_times", "text")} for r in results
            ],
        }
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        _plot(args.plot, results, metrics, duration, label)
    return metrics


def _plot(path: str, results: list[RequestResult], m: dict[str, Any], duration: float, title: str) -> None:
    from serve_plot import plot

    plot(path, results, m, duration, title, *timelines([r for r in results if r.success], duration))


def replot(result_json: str, png: str) -> None:
    """Draws the PNG of a run from its --result-json (e.g. one made on a machine without
    matplotlib): chunk times are rebuilt from each request's start, TTFT and ITL gaps."""
    with open(result_json, encoding="utf-8") as f:
        data = json.load(f)
    results = []
    for r in data["requests"]:
        rr = RequestResult(**{k: r[k] for k in ("success", "error", "start", "ttft", "latency", "itl",
                                                 "prompt_len", "output_len")})
        first = rr.start + rr.ttft
        rr.chunk_times = [first] + list(first + np.cumsum(rr.itl)) if rr.success else []
        results.append(rr)
    _plot(png, results, data["metrics"], data["metrics"]["duration_s"], data["label"])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--replot":
        replot(sys.argv[2], sys.argv[3])  # python benchmarks/serve.py --replot RESULT.json OUT.png
        sys.exit(0)
    m = main()
    sys.exit(0 if m["completed"] else 1)
