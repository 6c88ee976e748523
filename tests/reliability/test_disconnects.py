"""Disconnects: 50 streaming clients hang up at once, at different moments (before the first
token, right after it, a few tokens in; politely with a FIN or abruptly with a TCP RST).
Every one of their requests is aborted, every KV block comes back, and the server logs no
unhandled exception."""

from __future__ import annotations

import asyncio
import time

import pytest

from reliability_utils import assert_healthy, finished_count, hang_up_mid_stream, read_metrics, wait_idle

pytestmark = pytest.mark.timeout(120)

NUM_CLIENTS = 50
# Long enough that no request can finish before its client hangs up (with ignore_eos).
MAX_TOKENS = 200


def _plan(i: int) -> dict:
    """Client i's moment of hanging up: after how many events, how long after, FIN or RST."""
    after_events, delay = [(0, 0.0), (0, 0.2), (1, 0.0), (2, 0.0), (5, 0.05)][i % 5]
    return {"after_events": after_events, "delay": delay, "reset": i % 2 == 1}


def test_50_streaming_clients_hang_up(rel_server):
    before = wait_idle(rel_server)
    log_start = len(rel_server.log_text())

    async def client(i: int) -> int:
        body = {"prompt": f"Client {i} wants a very long story about", "max_tokens": MAX_TOKENS,
                "temperature": 0.7, "seed": i, "ignore_eos": True}
        path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
        if path.endswith("chat/completions"):
            body = {k: v for k, v in body.items() if k != "prompt"}
            body["messages"] = [{"role": "user", "content": f"Client {i}: tell me a very long story."}]
        return await hang_up_mid_stream(rel_server.port, body, path=path, **_plan(i))

    async def run() -> list[int]:
        return await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(NUM_CLIENTS))), 90)

    seen = asyncio.run(run())
    # The plan was followed: the clients that waited for tokens got them before hanging up.
    assert all(n >= _plan(i)["after_events"] for i, n in enumerate(seen))

    # Every request was aborted (none finished another way) and every block came back.
    start = time.monotonic()
    after = wait_idle(rel_server, timeout=20)
    freed_in = time.monotonic() - start
    aborted = finished_count(after, "abort") - finished_count(before, "abort")
    finished = {r: finished_count(after, r) - finished_count(before, r) for r in ("stop", "length", "error")}
    assert aborted == NUM_CLIENTS, (aborted, finished)
    assert finished == {"stop": 0, "length": 0, "error": 0}
    assert freed_in < 20

    # Nothing is still generating: the token counter stands still.
    generated = read_metrics(rel_server.url)["pagedllm:generation_tokens_total"]
    time.sleep(0.5)
    assert read_metrics(rel_server.url)["pagedllm:generation_tokens_total"] == generated

    assert_healthy(rel_server)
    assert rel_server.unhandled_errors(since=log_start) == []
