"""Soak: 2,000 mixed requests at high concurrency (completions and chat, streamed and not, n up
to 3, several prompts in one request, stop strings, token-id prompts, and clients that hang up
mid-stream). Every request is answered with a well-formed response, the hung-up ones are
aborted, the block pool is entirely free at the end, and the server's resident memory grows by
less than RSS_GROWTH_LIMIT_MIB between the end of the warm-up and the end of the soak -- or, where
it does not, keeps to that rate over EXTRA requests more (a leak does not stop growing)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from reliability_utils import AUTH, assert_healthy, finished_count, read_metrics, wait_idle

pytestmark = pytest.mark.timeout(300)

NUM_REQUESTS = 2000
WARMUP = 300  # requests before the first memory reading (allocator pools, caches, JIT paths)
CONCURRENCY = 48  # beyond --max-num-seqs 32: some requests always wait
# Resident memory may grow this much over the 1,700 requests after the warm-up: about 20 KiB per
# request; a leak of the request's state, its output or its KV bookkeeping would exceed it.
RSS_GROWTH_LIMIT_MIB = 32
# requests run again when the growth passes the limit, to tell a leak (which keeps growing at
# its rate) from a one-time high-water mark
EXTRA = 1000
EXTRA_PASSES = 3
TIME_LIMIT_S = 200
WORDS = "the quick brown fox jumps over lazy dogs while seven wizards quietly hex a jovial king".split()
STOPS = ["e", " the", "\n", "s ", "."]


def _request(i: int, rng: random.Random) -> dict:
    """Request i of the mix: {"path", "body", "stream", "hang_up", "num_choices", "stop"}."""
    kind = i % 10
    chat = kind in (2, 3, 7)
    stream = kind in (1, 3, 5, 8, 9)
    hang_up = kind == 9 and i % 20 == 9  # 5% of the requests
    n = 1 + (i % 7) % 3 if kind in (4, 5, 6, 7) else 1
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    body: dict = {"max_tokens": rng.randint(1, 6), "n": n, "seed": i}
    body["temperature"] = 0.0 if i % 3 == 0 else 0.8
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    stop = STOPS[i % len(STOPS)] if kind in (6, 7, 8) else None
    if stop:
        body["stop"] = [stop]
    num_prompts = 1
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    elif kind == 0:
        body["prompt"] = [rng.randrange(100, 10000) for _ in range(rng.randint(1, 40))]
    elif kind == 4:
        body["prompt"] = [words, words[::-1] or "x"]
        num_prompts = 2
    else:
        body["prompt"] = words
    if stream and i % 4 == 1:
        body["stream_options"] = {"include_usage": True}
    if hang_up:
        # long enough that the client's hang-up (after the first event) always comes first: with 64
        # tokens a loaded 2-core machine once let one finish before its disconnect was seen (99 of
        # 100 aborted); 180 + a prompt of <= 24 words stays within the server's 256
        body.update(max_tokens=180, ignore_eos=True, n=1)
        body.pop("stop", None)
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body, "stream": stream,
            "hang_up": hang_up, "num_choices": num_prompts * body["n"], "stop": stop}


def _check_text(req: dict, texts: dict[int, str], reasons: dict[int, str]) -> None:
    assert sorted(texts) == list(range(req["num_choices"])), texts
    assert sorted(reasons) == list(range(req["num_choices"])), reasons
    for i, reason in reasons.items():
        assert reason in ("stop", "length"), reason
        if req["stop"]:
            assert req["stop"] not in texts[i], (req, texts[i])


async def _plain(client: httpx.AsyncClient, req: dict) -> None:
    r = await client.post(req["path"], json=req["body"], headers=AUTH)
    assert r.status_code == 200, r.text
    data = r.json()
    chat = "messages" in req["body"]
    texts = {c["index"]: c["message"]["content"] if chat else c["text"] for c in data["choices"]}
    _check_text(req, texts, {c["index"]: c["finish_reason"] for c in data["choices"]})
    usage = data["usage"]
    assert 1 <= usage["completion_tokens"] <= req["body"]["max_tokens"] * req["num_choices"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def _streamed(client: httpx.AsyncClient, req: dict) -> None:
    chat = "messages" in req["body"]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    done = False
    usage = None
    async with client.stream("POST", req["path"], json={**req["body"], "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            assert not done, "an event after [DONE]"
            event = json.loads(line[6:])
            assert "error" not in event, event
            if req["hang_up"]:
                return  # leave after the first event: the connection closes with the context
            if event.get("usage"):
                usage = event["usage"]
            for c in event["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c.get("finish_reason"):
                    assert c["index"] not in reasons, "two finish reasons for one choice"
                    reasons[c["index"]] = c["finish_reason"]
    assert done, "the stream ended without [DONE]"
    _check_text(req, texts, reasons)
    if req["body"].get("stream_options"):
        assert usage and usage["completion_tokens"] >= 1


def _soak(rel_server, plan: list[dict], warmup: int, rss: dict[str, int]) -> tuple[list[str], int, float]:
    """Sends the plan at CONCURRENCY; rss["warm"] is read after `warmup` requests. Returns
    (failures, requests completed, seconds)."""
    failures: list[str] = []
    completed = 0

    async def worker(client: httpx.AsyncClient, queue: asyncio.Queue) -> None:
        nonlocal completed
        while True:
            i = await queue.get()
            if i is None:
                return
            req = plan[i]
            try:
                await (_streamed if req["stream"] else _plain)(client, req)
            except Exception as e:  # noqa: BLE001 - collected, reported together
                failures.append(f"request {i} {req}: {e!r}")
            completed += 1
            if completed == warmup:
                rss["warm"] = rel_server.rss_kib()

    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(len(plan)):
            queue.put_nowait(i)
        for _ in range(CONCURRENCY):
            queue.put_nowait(None)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=rel_server.url, timeout=60, limits=limits, trust_env=False) as client:
            await asyncio.wait_for(
                asyncio.gather(*(worker(client, queue) for _ in range(CONCURRENCY))), TIME_LIMIT_S
            )

    start = time.monotonic()
    asyncio.run(run())
    return failures, completed, time.monotonic() - start


def test_soak_2000_mixed_requests(rel_server):
    before = wait_idle(rel_server)
    rng = random.Random(1234)
    plan = [_request(i, rng) for i in range(NUM_REQUESTS)]
    rss: dict[str, int] = {}
    failures, completed, elapsed = _soak(rel_server, plan, WARMUP, rss)
    assert failures == [], f"{len(failures)} of {NUM_REQUESTS} requests went wrong:\n" + "\n".join(failures[:10])
    assert completed == NUM_REQUESTS

    after = wait_idle(rel_server, timeout=30)  # every block back in the free pool
    rss["end"] = rel_server.rss_kib()
    hung_up = sum(1 for r in plan if r["hang_up"])
    aborted = finished_count(after, "abort") - finished_count(before, "abort")
    assert aborted == hung_up
    assert finished_count(after, "error") == finished_count(before, "error")
    growth_mib = (rss["end"] - rss["warm"]) / 1024
    print(f"soak: {NUM_REQUESTS} requests in {elapsed:.1f} s ({NUM_REQUESTS / elapsed:.0f} req/s); "
          f"RSS {rss['warm'] / 1024:.0f} MiB after warm-up, {rss['end'] / 1024:.0f} MiB at the end "
          f"(+{growth_mib:.1f} MiB); {hung_up} clients hung up")
    if growth_mib >= RSS_GROWTH_LIMIT_MIB:
        # A leak keeps growing; the allocator's high-water mark, reached when a late step happens
        # to be the largest yet, does not (this machine, 2026-12-04: +0.2 to +66 MiB over 1,700
        # requests from run to run, +0.7 over 5,700 in one long run). So the same mix runs again,
        # up to EXTRA_PASSES times: a leak grows past its rate in every pass.
        limit = RSS_GROWTH_LIMIT_MIB * EXTRA / (NUM_REQUESTS - WARMUP)
        passes = []
        for _ in range(EXTRA_PASSES):
            extra: dict[str, int] = {}
            failures, _, _ = _soak(rel_server, plan[:EXTRA], 1, extra)
            assert failures == [], failures[:10]
            wait_idle(rel_server, timeout=30)
            passes.append((rel_server.rss_kib() - extra["warm"]) / 1024)
            print(f"soak: {EXTRA} more requests: +{passes[-1]:.1f} MiB")
            if passes[-1] < limit:
                break
        assert passes[-1] < limit, f"resident memory grew {growth_mib:.1f} MiB, then {passes} MiB a pass"
    assert_healthy(rel_server)
    assert rel_server.unhandled_errors() == []
    assert read_metrics(rel_server.url)["pagedllm:kv_cache_usage_perc"] == 0.0
