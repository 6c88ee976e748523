"""The engine page: `GET /` serves a chat playground and a live view of the engine (KV block
map, each step's batch, queues, latency histograms, throughput), from static files inside the
package (`static/`, no CDN, no JS library).

The live view reads `GET /ui/events`, a server-sent-events stream of engine snapshots
(`pagedllm.engine.snapshot`), and `/metrics` for the histograms. Snapshots are taken on the
server's event-loop thread at most every `SNAPSHOT_INTERVAL_S` whatever the number of pages
open, and only while a page is open; the engine's step path does no work for them.

With an API key set, the snapshot routes (and the chat, which calls /v1) need it: as a Bearer
header or as the `pagedllm_api_key` cookie the page sets when the user types the key in. The
page's static files carry no engine data and are served to anyone.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.snapshot import SnapshotCache

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
SNAPSHOT_INTERVAL_S = 0.5
COOKIE = "pagedllm_api_key"
_ASSETS = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def _read_static_files() -> dict[str, bytes]:
    """The page's files, read once at start-up: no request handler touches a file."""
    files = {}
    for name in _ASSETS:
        with open(os.path.join(STATIC_DIR, name), "rb") as f:
            files[name] = f.read()
    return files


def register_engine_page(app: FastAPI, engine: Any, api_keys: list[str]) -> None:
    """Adds `/`, `/ui/{asset}`, `/ui/state` and `/ui/events` to `app` (an AsyncLLMEngine's)."""
    cache = SnapshotCache(engine.engine, SNAPSHOT_INTERVAL_S)
    files = _read_static_files()
    digests = [_digest(k) for k in api_keys]

    def authorized(request: Request) -> bool:
        if not digests:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        sent = key.strip() if scheme.lower() == "bearer" else request.cookies.get(COOKIE, "")
        d = _digest(sent)
        ok = False
        for ref in digests:  # every key compared, in constant time
            ok |= hmac.compare_digest(d, ref)
        return ok and bool(sent)

    def denied() -> JSONResponse:
        return JSONResponse(
            {"error": {"message": "Incorrect or missing API key.", "type": "invalid_request_error",
                       "param": None, "code": "invalid_api_key"}},
            status_code=401,
        )

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(files["index.html"], media_type="text/html")

    @app.get("/ui/state", include_in_schema=False)
    async def state(request: Request) -> Response:
        if not authorized(request):
            return denied()
        return JSONResponse(cache.get())

    @app.get("/ui/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        if not authorized(request):
            return denied()

        async def stream() -> Any:
            while not await request.is_disconnected():
                yield f"data: {json.dumps(cache.get(), separators=(',', ':'))}\n\n"
                await asyncio.sleep(SNAPSHOT_INTERVAL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/ui/{asset}", include_in_schema=False)
    async def asset(asset: str) -> Response:
        if asset not in _ASSETS:
            return JSONResponse({"error": {"message": f"no asset {asset!r}", "type": "invalid_request_error",
                                           "param": None, "code": "not_found"}}, status_code=404)
        return Response(files[asset], media_type=_ASSETS[asset])
