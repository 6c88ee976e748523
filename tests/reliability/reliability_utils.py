"""Helpers of the reliability suite: the real server as a subprocess on 127.0.0.1 (with its log,
its resident memory and its Prometheus metrics at hand), a check that the server is idle with
every KV block free, an SSE reader, and a raw-socket client that hangs up mid-stream.

Every helper is bounded in time and talks only to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
import time
from dataclasses import dataclass, field

import pytest
import requests

HOST = "127.0.0.1"
API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL_NAME = "tiny"

# The tiny Llama (2 layers, 2 KV heads of 16) holds 512 bytes of KV per token: 512 KiB is 64
# blocks of 16 tokens, 1,024 tokens in all, so that four requests of max_model_len fill it and
# preemption and overload are cheap to reach.
MAX_MODEL_LEN = 256
KV_CACHE_TOKENS = 1024
MAX_NUM_SEQS = 32
BODY_LIMIT = 256 << 10
SERVER_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN),
    "--kv-cache-memory", "512KiB",
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--served-model-name", MODEL_NAME,
    "--api-key", API_KEY,
    "--max-request-body-size", str(BODY_LIMIT),
    "--disable-uvicorn-access-log",
    "--shutdown-timeout", "2",
]

from server_process import ServerProcess  # noqa: E402


# ---- metrics ------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def read_metrics(url: str) -> dict[str, float]:
    """/metrics as {"name{labels}": value}, plus {"name": sum over its label sets}."""
    text = requests.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        if labels:
            out[name] = out.get(name, 0.0) + value
    return out


def finished_count(metrics: dict[str, float], reason: str) -> float:
    return metrics.get(f'pagedllm:request_success_total{{finished_reason="{reason}",model_name="{MODEL_NAME}"}}', 0.0)


IDLE_GAUGES = ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
               "pagedllm:num_requests_swapped", "pagedllm:kv_cache_usage_perc")


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    """Wait until nothing runs, waits or is swapped and every KV block is free (usage exactly 0:
    blocks that only the prefix cache remembers count as free); fail with the gauges if that does
    not happen in `timeout` seconds. Returns the last metrics read."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(server.url)
        if all(metrics.get(g, -1.0) == 0.0 for g in IDLE_GAUGES):
            return metrics
        if time.monotonic() > deadline:
            state = {g: metrics.get(g) for g in IDLE_GAUGES}
            pytest.fail(f"server not idle after {timeout} s (leaked blocks or requests?): {state}")
        time.sleep(0.1)


def assert_healthy(server: ServerProcess) -> None:
    assert server.proc.poll() is None, f"server died:\n{server.log_tail()}"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def greedy_reference(llm, prompts: list, max_tokens: int) -> list[str]:
    """What the server must answer to these prompts (text or token ids) under greedy decoding
    with ignore_eos, according to the offline engine `llm` on the same weights."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return [out.outputs[0].text for out in llm.generate(inputs, params, use_tqdm=False)]


# ---- clients ------------------------------------------------------------------------------------


@dataclass
class SSEResult:
    """What one streamed request returned: its HTTP status, its data events (parsed JSON; the
    error body when the status is not 200), and whether [DONE] ended it."""

    status: int
    events: list[dict] = field(default_factory=list)
    done: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]

    def text(self, index: int = 0) -> str:
        parts = []
        for e in self.events:
            for c in e.get("choices", []):
                if c.get("index") == index:
                    parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return "".join(parts)

    def finish_reasons(self) -> dict[int, str]:
        return {c["index"]: c["finish_reason"] for e in self.events for c in e.get("choices", [])
                if c.get("finish_reason")}


async def stream_request(client, path: str, body: dict, headers: dict | None = None) -> SSEResult:
    """POST with stream=true through an httpx.AsyncClient and read the whole event stream."""
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers or AUTH) as r:
        result = SSEResult(status=r.status_code, headers=dict(r.headers))
        if r.status_code != 200:
            await r.aread()
            result.events.append(r.json())
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            assert not result.done, "an event after [DONE]"
            result.events.append(json.loads(data))
        return result


def _http_request(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


async def hang_up_mid_stream(
    port: int, body: dict, *, after_events: int, delay: float = 0.0, reset: bool = False,
    path: str = "/v1/completions", timeout: float = 60.0,
) -> int:
    """Send a streaming request over a raw socket, read until `after_events` SSE data events have
    arrived (0: none; then wait `delay` seconds), and hang up: a FIN, or with `reset` a TCP RST.
    Returns the number of data events seen before hanging up."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), timeout)
    try:
        writer.write(_http_request(path, {**body, "stream": True}))
        await writer.drain()
        seen = b""
        events = 0
        deadline = time.monotonic() + timeout
        while events < after_events:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.1, deadline - time.monotonic()))
            if not chunk:
                raise AssertionError(f"the server closed the stream after {events} events: {seen[-500:]!r}")
            seen += chunk
            if events == 0 and not seen.startswith(b"HTTP/1.1 200"):
                if b"\r\n\r\n" in seen:
                    raise AssertionError(f"unexpected response: {seen[:500]!r}")
            events = seen.count(b"data: ")
        if delay:
            await asyncio.sleep(delay)
        return events
    finally:
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
