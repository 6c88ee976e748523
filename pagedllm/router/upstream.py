"""One attempt of a request at one backend, and what its outcome means for the retry loop.

An attempt ends, before any byte has gone to the client, in one of:
  - `ok`: a 2xx whose headers arrived (a stream: its first body chunk is read too, so that
    the tier's timeout covers the first token; a plain answer: its whole body);
  - `client_error`: a 4xx other than 429, which is the request's fault: passed on, not retried;
  - `busy`: 429 / 503, with the Retry-After the backend asked for: retried elsewhere, and the
    backend skipped for that long;
  - `failed`: a connection error, a timeout or a 5xx: retried elsewhere, counted by the breaker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from pagedllm.router.backends import Backend

_KEEP_HEADERS = ("content-type", "retry-after")


@dataclass(slots=True)
class Outcome:
    kind: str                              # ok | client_error | busy | failed
    status: int = 0
    headers: dict[str, str] | None = None
    body: bytes = b""                      # a plain answer's body, or a stream's first chunk
    response: httpx.Response | None = None  # an open stream (kind ok and streaming) ...
    chunks: AsyncIterator[bytes] | None = None  # ... and the rest of its body
    reason: str = ""                       # why it failed: connect, timeout, read, http_5xx, ...


def classify_status(status: int) -> str:
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "busy"
    if status < 500:
        return "client_error"
    return "failed"


async def attempt(
    client: httpx.AsyncClient, backend: Backend, path: str, payload: bytes, *, stream: bool, timeout_s: float
) -> Outcome:
    """Send `payload` to `backend`; give up after `timeout_s` without a first byte. Cancelling
    the coroutine (the client went away) closes the upstream connection, which aborts the
    request at a pagedllm or vLLM backend."""
    headers = {"content-type": "application/json", **backend.auth_headers}
    request = client.build_request("POST", backend.url + path, content=payload, headers=headers)

    async def run() -> Outcome:
        response = await client.send(request, stream=True)
        try:
            kind = classify_status(response.status_code)
            if stream and kind == "ok":
                chunks = response.aiter_raw()
                first = b""
                while not first:
                    first = await chunks.__anext__()  # StopAsyncIteration: an empty stream
                out = Outcome(kind, response.status_code, _headers(response), first, response, chunks)
                response = None  # the caller owns the open stream now
                return out
            body = await response.aread()
            return Outcome(kind, response.status_code, _headers(response), body,
                           reason="" if kind == "ok" else f"http_{response.status_code}")
        finally:
            if response is not None:
                await response.aclose()

    try:
        return await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        return Outcome("failed", reason="timeout")
    except httpx.ConnectError:
        return Outcome("failed", reason="connect")
    except (httpx.HTTPError, httpx.StreamError, OSError, StopAsyncIteration) as e:
        return Outcome("failed", reason=type(e).__name__)


def _headers(response: httpx.Response) -> dict[str, str]:
    return {k: response.headers[k] for k in _KEEP_HEADERS if k in response.headers}
