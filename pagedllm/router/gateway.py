"""The router's HTTP side: a plain ASGI app (no framework between the socket and the stream, so
a stream's chunks leave as they arrive and the overhead per request stays small).

Routes: POST /v1/completions and /v1/chat/completions (proxied), GET /v1/models, /health (200
while some backend is in rotation), /metrics (the router's own, Prometheus), and
/router/backends (every backend's health, circuit, load, as JSON). With an API key, /v1 and
/router need `Authorization: Bearer KEY`.

A request is placed by the Planner, tried at up to `max_attempts` backends (the tier's replicas
in the balancer's order, then the route's other tiers) until one answers before its tier's
timeout; a cascade may then escalate a plain answer to the next tier. Once the first byte has
gone to the client nothing is retried: a stream that breaks ends with an SSE error event. A
client that goes away cancels the attempt, which closes the upstream connection (the backend
aborts the request). Every error is OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pagedllm.entrypoints.json_body import JSONBodyError, parse_json_object
from pagedllm.router.backends import Backend
from pagedllm.router.balance import Balancer
from pagedllm.router.config import RouterConfig
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.policy import Plan, Planner, RouteError, request_logprobs, strip_logprobs
from pagedllm.router.upstream import Outcome, attempt

logger = logging.getLogger(__name__)

_PROXIED = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> is chat


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


class Router:
    """The ASGI app: `uvicorn.run(Router(cfg))`. Owns the backends, their monitors, one
    connection pool for all upstream calls, and the router's metrics."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.planner = Planner(cfg)
        self.tiers: dict[str, list[Backend]] = {
            t.name: [Backend(b, t.name, cfg.breaker) for b in t.backends] for t in cfg.tiers
        }
        self.backends = [b for bs in self.tiers.values() for b in bs]
        self.timeouts = {t.name: t.effective_timeout_s for t in cfg.tiers}
        self.metrics = RouterMetrics()
        self._balancers: dict[tuple[str, str], Balancer] = {}
        self._served: dict[str, list[str]] = {}
        self._api_key = hashlib.sha256(cfg.api_key.encode()).digest() if cfg.api_key else None
        self._client: httpx.AsyncClient | None = None
        self._monitors: list[asyncio.Task] = []
        self._routes = {"/health": self._health, "/metrics": self._metrics, "/v1/models": self._models,
                        "/router/backends": self._backend_status}

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=4.0)
        self._client = httpx.AsyncClient(limits=limits, timeout=None, trust_env=False)
        hc = self.cfg.health
        await asyncio.gather(*(self._discover(b) for b in self.backends if not b.models))
        self._served = {}
        for b in self.backends:
            for m in b.models:
                tiers = self._served.setdefault(m, [])
                if b.tier not in tiers:
                    tiers.append(b.tier)
        await asyncio.gather(*(b.check_health(self._client, hc) for b in self.backends))
        self._monitors = [asyncio.ensure_future(b.run_monitor(self._client, hc)) for b in self.backends]

    async def _discover(self, b: Backend) -> None:
        assert self._client is not None
        try:
            await b.discover_models(self._client, self.cfg.health.timeout_s * 5)
        except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
            raise RuntimeError(f"cannot list the models of {b.url} (give `models:` in the config): {e}") from e

    async def stop(self) -> None:
        for t in self._monitors:
            t.cancel()
        await asyncio.gather(*self._monitors, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as e:  # noqa: BLE001 - reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- routes ---------------------------------------------------------------------------------

    async def _http(self, scope: dict, receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        if self._api_key is not None and (path.startswith("/v1") or path.startswith("/router")):
            if not self._authorized(scope):
                await _json(send, 401, _error("Incorrect or missing API key; send it as 'Authorization: "
                                              "Bearer KEY'.", "invalid_api_key"), {"www-authenticate": "Bearer"})
                return
        if path in _PROXIED:
            if method != "POST":
                await _json(send, 405, _error(f"{method} is not allowed on {path}", "method_not_allowed"))
                return
            await self._proxy(scope, receive, send, path)
            return
        handler = self._routes.get(path)
        if handler is None:
            await _json(send, 404, _error(f"no route {path}", "not_found"))
        elif method not in ("GET", "HEAD"):
            await _json(send, 405, _error(f"{method} is not allowed on {path}", "method_not_allowed"))
        else:
            await handler(send)

    def _authorized(self, scope: dict) -> bool:
        header = b""
        for k, v in scope.get("headers") or []:
            if k == b"authorization":
                header = v
        scheme, _, key = header.partition(b" ")
        key = key.strip() if scheme.lower() == b"bearer" else b""
        return hmac.compare_digest(hashlib.sha256(key).digest(), self._api_key or b"") and bool(key)

    async def _health(self, send: Any) -> None:
        now = time.monotonic()
        up = sum(b.available(now) for b in self.backends)
        if up:
            await _json(send, 200, {"status": "ok", "backends_available": up})
        else:
            await _json(send, 503, _error("no backend is available", "no_backend_available", 503))

    async def _metrics(self, send: Any) -> None:
        self.metrics.refresh_backends(self.backends, time.monotonic())
        body = self.metrics.exposition()
        await _respond(send, 200, body, {"content-type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _models(self, send: Any) -> None:
        names = [m for r in self.cfg.routes for m in r.models] + [t.name for t in self.cfg.tiers] + list(self._served)
        now = int(time.time())
        cards = [{"id": n, "object": "model", "created": now, "owned_by": "pagedllm-router"} for n in dict.fromkeys(names)]
        await _json(send, 200, {"object": "list", "data": cards})

    async def _backend_status(self, send: Any) -> None:
        now = time.monotonic()
        await _json(send, 200, {"backends": [b.status(now) for b in self.backends]})

    # ---- proxying -------------------------------------------------------------------------------

    async def _proxy(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        t0 = time.monotonic()
        try:
            raw = await _read_body(scope, receive, self.cfg.max_request_body_size)
            body = _parse(raw)
            plan = self.planner.plan(body, self._served)
        except ClientGone:
            return
        except RouteError as e:
            self.metrics.requests.labels("none", "none", str(e.status_code)).inc()
            await _json(send, e.status_code, e.body(), e.headers)
            return
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            if body.get("stream"):
                await self._proxy_stream(send, path, body, raw, plan, disconnect, t0)
            else:
                await self._proxy_unary(send, path, body, raw, plan, disconnect, t0)
        except ClientGone:
            self.metrics.requests.labels(plan.route.name, "none", "499").inc()
        finally:
            disconnect.cancel()

    def _balancer(self, route: str, tier: str, policy: str, plan: Plan) -> Balancer:
        key = (route, tier)
        b = self._balancers.get(key)
        if b is None:
            b = self._balancers[key] = Balancer(policy, plan.route.prefix_affinity)
        return b

    async def _first_answer(self, path: str, body: dict, raw: bytes, plan: Plan, tiers: list[str], *,
                            stream: bool, disconnect: asyncio.Future) -> tuple[Outcome, Backend | None, int]:
        """Try backends until one answers before its tier's timeout. Returns the outcome (the
        last failure when none did), its backend, and the number of attempts."""
        tried: set[int] = set()
        attempts = 0
        last = Outcome("failed", 503, reason="no_backend")
        last_backend: Backend | None = None
        retry_after: float | None = None
        assert self._client is not None
        for tier in tiers:
            while attempts < self.cfg.max_attempts:
                now = time.monotonic()
                pool = [b for b in self.tiers[tier] if id(b) not in tried and b.available(now)
                        and (plan.served_model is None or plan.served_model in b.models)]
                if not pool:
                    break
                backend = self._balancer(plan.route.name, tier, plan.route.balance, plan).order(pool, plan.prefix_key)[0]
                tried.add(id(backend))
                attempts += 1
                payload = raw if plan.served_model is not None and body.get("model") == plan.served_model \
                    else json.dumps({**body, "model": backend.models[0]}).encode()
                backend.begin()
                task = asyncio.ensure_future(attempt(self._client, backend, path, payload, stream=stream,
                                                     timeout_s=self.timeouts[tier]))
                done, _ = await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if task not in done:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    backend.end(None, time.monotonic())
                    raise ClientGone()
                out = task.result()
                now = time.monotonic()
                if out.kind in ("ok", "client_error"):
                    if out.kind == "client_error" or not stream:  # done; an open stream ends later
                        backend.end(True if out.kind == "ok" else None, now)
                    return out, backend, attempts
                if out.kind == "busy":
                    retry_after = backend.honour_retry_after((out.headers or {}).get("retry-after"),
                                                             self.cfg.default_retry_after_s, now)
                    backend.end(None, now)
                    out.reason = f"busy_{out.status}"
                else:
                    backend.end(False, now)
                logger.info("attempt %d at %r failed (%s); retrying", attempts, backend, out.reason)
                self.metrics.retries.labels(tier, out.reason).inc()
                last, last_backend = out, backend
        if last.kind == "busy" or last.reason == "no_backend":
            wait = retry_after if retry_after is not None else self._soonest_retry()
            last.headers = {**(last.headers or {}), "retry-after": str(max(1, round(wait)))}
        return last, last_backend, attempts

    def _soonest_retry(self) -> float:
        now = time.monotonic()
        waits = [b.retry_after_until - now for b in self.backends if b.retry_after_until > now]
        return min(waits) if waits else self.cfg.default_retry_after_s

    async def _fail(self, send: Any, plan: Plan, out: Outcome, attempts: int, t0: float) -> None:
        """No backend answered: the last backend's own error if it sent one, else a 502 / 503."""
        headers = {"x-pagedllm-router-attempts": str(attempts), **(out.headers or {})}
        if out.status and out.body:
            status, body = out.status, out.body
        elif out.reason == "no_backend":
            status, body = 503, json.dumps(_error(
                f"no backend of route {plan.route.name!r} is available (tiers {plan.tiers})",
                "no_backend_available", 503)).encode()
        else:
            status, body = 502, json.dumps(_error(
                f"every attempt failed ({attempts} attempts; last: {out.reason})", "upstream_failed", 502)).encode()
        headers["content-type"] = "application/json"
        self.metrics.requests.labels(plan.route.name, "none", str(status)).inc()
        await _respond(send, status, body, headers)

    async def _proxy_unary(self, send: Any, path: str, body: dict, raw: bytes, plan: Plan,
                           disconnect: asyncio.Future, t0: float) -> None:
        client_logprobs = True
        if plan.cascade is not None and plan.cascade.min_mean_logprob is not None:
            body, client_logprobs = request_logprobs(body, _PROXIED[path])
            raw = json.dumps(body).encode()
        out, backend, attempts = await self._first_answer(path, body, raw, plan, plan.tiers, stream=False,
                                                          disconnect=disconnect)
        if out.kind not in ("ok", "client_error") or backend is None:
            await self._fail(send, plan, out, attempts, t0)
            return
        escalations = 0
        answer_body = out.body
        if out.kind == "ok" and plan.cascade is not None:
            try:
                answer = json.loads(out.body)
            except ValueError:
                answer = None
            while isinstance(answer, dict):
                reason = self.planner.weak_answer(plan, answer)
                up = self.planner.escalation(plan, backend.tier) if reason else None
                if up is None:
                    break
                self.metrics.escalations.labels(plan.route.name, backend.tier, up, reason).inc()
                higher, hb, n = await self._first_answer(path, body, raw, plan, [up], stream=False,
                                                         disconnect=disconnect)
                attempts += n
                if higher.kind != "ok" or hb is None:  # the higher tier failed: keep the answer we have
                    break
                escalations += 1
                out, backend = higher, hb
                try:
                    answer = json.loads(higher.body)
                except ValueError:
                    answer_body, answer = higher.body, None
            if isinstance(answer, dict):
                answer_body = json.dumps(answer if client_logprobs else strip_logprobs(answer)).encode()
        now = time.monotonic()
        self.metrics.requests.labels(plan.route.name, backend.tier, str(out.status)).inc()
        self.metrics.ttfb.labels(backend.tier).observe(now - t0)
        self.metrics.latency.labels(backend.tier).observe(now - t0)
        headers = {**(out.headers or {}), **_placement_headers(backend, attempts, escalations)}
        await _respond(send, out.status, answer_body, headers)

    async def _proxy_stream(self, send: Any, path: str, body: dict, raw: bytes, plan: Plan,
                            disconnect: asyncio.Future, t0: float) -> None:
        out, backend, attempts = await self._first_answer(path, body, raw, plan, plan.tiers, stream=True,
                                                          disconnect=disconnect)
        if out.kind != "ok" or backend is None:
            if out.kind == "client_error" and backend is not None:
                self.metrics.requests.labels(plan.route.name, backend.tier, str(out.status)).inc()
                await _respond(send, out.status, out.body, {**(out.headers or {}),
                                                            **_placement_headers(backend, attempts, 0)})
            else:
                await self._fail(send, plan, out, attempts, t0)
            return
        response = out.response
        assert response is not None
        ok: bool | None = True
        try:
            headers = {**(out.headers or {}), "cache-control": "no-cache", **_placement_headers(backend, attempts, 0)}
            await send({"type": "http.response.start", "status": out.status,
                        "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
            self.metrics.ttfb.labels(backend.tier).observe(time.monotonic() - t0)
            await send({"type": "http.response.body", "body": out.body, "more_body": True})
            assert out.chunks is not None
            pump = asyncio.ensure_future(_pump(out.chunks, send))
            done, _ = await asyncio.wait({pump, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if pump not in done:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
                ok = None
                raise ClientGone()
            error = pump.result()
            if error is not None:  # the backend broke off mid-stream: too late to retry
                ok = False
                logger.warning("stream from %r broke off: %s", backend, error)
                event = _error(f"the backend stopped mid-stream: {error}", "upstream_failed", 502)
                await send({"type": "http.response.body", "more_body": True,
                            "body": f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()
            now = time.monotonic()
            backend.end(ok, now)
            if ok is not None:
                self.metrics.requests.labels(plan.route.name, backend.tier, str(out.status)).inc()
                self.metrics.latency.labels(backend.tier).observe(now - t0)


async def _pump(chunks: AsyncIterator[bytes], send: Any) -> str | None:
    """Pass the stream's chunks on as they come; a broken upstream returns its error."""
    try:
        async for chunk in chunks:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except (httpx.HTTPError, httpx.StreamError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _placement_headers(backend: Backend, attempts: int, escalations: int) -> dict[str, str]:
    return {"x-pagedllm-router-tier": backend.tier, "x-pagedllm-router-backend": backend.url,
            "x-pagedllm-router-attempts": str(attempts), "x-pagedllm-router-escalations": str(escalations)}


def _error(message: str, code: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        return parse_json_object(raw)
    except JSONBodyError as e:
        raise RouteError(str(e), code=e.code) from None


async def _read_body(scope: dict, receive: Any, limit: int) -> bytes:
    for k, v in scope.get("headers") or []:
        if k == b"content-length" and v.isdigit() and int(v) > limit:
            raise RouteError(f"request body of {int(v)} bytes exceeds the limit of {limit} bytes",
                             413, code="request_too_large")
    chunks, total = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise RouteError(f"request body exceeds the limit of {limit} bytes", 413, code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(send: Any, status: int, body: bytes, headers: dict[str, str]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()]
                + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Any, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    await _respond(send, status, json.dumps(payload).encode(), {"content-type": "application/json", **(headers or {})})
