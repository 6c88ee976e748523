"""One backend's state as the router sees it, and the loops that keep it current.

A backend is available when its health checks pass (`unhealthy_threshold` failures in a row take
it out, `healthy_threshold` passes put it back), its circuit breaker lets requests through, and no
`Retry-After` it sent is still running. Its load is read from its own Prometheus /metrics
(waiting + running requests, KV usage; pagedllm's `pagedllm:` names or vLLM's `vllm:` ones),
combined with the requests this router has in flight to it (which the metrics trail by up to a
poll interval). Everything here runs on the router's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import httpx

from pagedllm.router.config import BackendConfig, BreakerConfig, HealthConfig

logger = logging.getLogger(__name__)

_METRIC_LINE = re.compile(r"^(?:pagedllm|vllm):(\w+?)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$", re.MULTILINE)
_LOAD_METRICS = {
    "num_requests_running": "running", "num_requests_waiting": "waiting",
    "kv_cache_usage_perc": "kv_usage", "gpu_cache_usage_perc": "kv_usage",
    "prefix_cache_hits_total": "prefix_hits", "prefix_cache_queries_total": "prefix_queries",
}


def parse_load_metrics(text: str) -> dict[str, float]:
    """The load figures of a Prometheus exposition, summed over label sets."""
    out: dict[str, float] = {}
    for m in _METRIC_LINE.finditer(text):
        key = _LOAD_METRICS.get(m.group(1))
        if key is not None:
            try:
                out[key] = out.get(key, 0.0) + float(m.group(2))
            except ValueError:
                continue
    return out


class CircuitBreaker:
    """closed -> (failure_threshold failures in a row) -> open -> (cooldown_s) -> half open: one
    trial request; its success closes the circuit, its failure opens it again."""

    def __init__(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self.state = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.trial_in_flight = False

    def allows(self, now: float) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and now - self.opened_at >= self.cfg.cooldown_s:
            self.state = "half_open"
            self.trial_in_flight = False
        return self.state == "half_open" and not self.trial_in_flight

    def on_start(self) -> None:
        if self.state == "half_open":
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.state, self.failures, self.trial_in_flight = "closed", 0, False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state == "half_open" or self.failures >= self.cfg.failure_threshold:
            if self.state != "open":
                logger.warning("circuit opened after %d failures in a row", self.failures)
            self.state, self.opened_at = "open", now


@dataclass(slots=True)
class RemoteLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    ours_in_flight: int = 0    # the router's requests in flight there when the figures came
    updated_at: float = 0.0


class Backend:
    """A backend of a tier: config, health, load, breaker, and the router's in-flight count."""

    def __init__(self, cfg: BackendConfig, tier: str, breaker: BreakerConfig) -> None:
        self.cfg = cfg
        self.url = cfg.url
        self.tier = tier
        self.models: tuple[str, ...] = cfg.models
        self.healthy = True
        self.health_failures = 0
        self.health_passes = 0
        self.breaker = CircuitBreaker(breaker)
        self.retry_after_until = 0.0
        self.in_flight = 0
        self.load = RemoteLoad()

    def __repr__(self) -> str:
        return f"Backend({self.tier}:{self.url})"

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.retry_after_until and self.breaker.allows(now)

    def load_score(self) -> float:
        """Requests queued or running there: ours now, plus the others' its last /metrics showed
        (its running + waiting beyond the requests we had in flight when it answered, so that
        our own, which may have finished since, are not counted from a stale figure), plus KV
        usage in [0, 1] to break ties towards the emptier cache."""
        others = max(0.0, self.load.running + self.load.waiting - self.load.ours_in_flight)
        return self.in_flight + others + self.load.kv_usage

    def begin(self) -> None:
        self.in_flight += 1
        self.breaker.on_start()

    def end(self, ok: bool | None, now: float) -> None:
        """`ok`: True a success, False a failure the breaker counts, None neither (a client that
        went away, a 4xx that is the request's fault)."""
        self.in_flight -= 1
        if ok is True:
            self.breaker.on_success()
        elif ok is False:
            self.breaker.on_failure(now)
        else:
            self.breaker.trial_in_flight = False

    def honour_retry_after(self, value: str | None, default_s: float, now: float) -> float:
        """Keep requests away for the Retry-After seconds (or `default_s`); returns them."""
        seconds = default_s
        if value:
            try:
                seconds = max(0.0, float(value))
            except ValueError:
                pass
        self.retry_after_until = max(self.retry_after_until, now + seconds)
        return seconds

    def status(self, now: float) -> dict:
        return {
            "url": self.url, "tier": self.tier, "models": list(self.models), "healthy": self.healthy,
            "available": self.available(now), "circuit": self.breaker.state, "in_flight": self.in_flight,
            "retry_after_s": max(0.0, round(self.retry_after_until - now, 3)),
            "load": {"running": self.load.running, "waiting": self.load.waiting, "kv_usage": self.load.kv_usage},
        }

    # ---- the loops ---------------------------------------------------------------------------

    async def check_health(self, client: httpx.AsyncClient, cfg: HealthConfig) -> bool:
        try:
            r = await client.get(self.url + "/health", timeout=cfg.timeout_s, headers=self.auth_headers)
            ok = r.status_code == 200
        except (httpx.HTTPError, OSError):
            ok = False
        if ok:
            self.health_failures, self.health_passes = 0, self.health_passes + 1
            if not self.healthy and self.health_passes >= cfg.healthy_threshold:
                logger.info("%r passes its health checks again: back in rotation", self)
                self.healthy = True
        else:
            self.health_passes, self.health_failures = 0, self.health_failures + 1
            if self.healthy and self.health_failures >= cfg.unhealthy_threshold:
                logger.warning("%r failed %d health checks: taken out of rotation", self, self.health_failures)
                self.healthy = False
        return ok

    async def poll_metrics(self, client: httpx.AsyncClient, cfg: HealthConfig) -> None:
        try:
            r = await client.get(self.url + "/metrics", timeout=cfg.timeout_s, headers=self.auth_headers)
        except (httpx.HTTPError, OSError):
            return
        if r.status_code != 200:
            return
        values = parse_load_metrics(r.text)
        load = RemoteLoad(updated_at=time.monotonic(), ours_in_flight=self.in_flight)
        for key, value in values.items():
            setattr(load, key, value)
        self.load = load

    async def discover_models(self, client: httpx.AsyncClient, timeout: float) -> None:
        """Fill `models` from /v1/models when the config named none."""
        r = await client.get(self.url + "/v1/models", timeout=timeout, headers=self.auth_headers)
        r.raise_for_status()
        self.models = tuple(card["id"] for card in r.json().get("data", []))
        if not self.models:
            raise ValueError(f"{self.url}/v1/models lists no model")

    async def run_monitor(self, client: httpx.AsyncClient, cfg: HealthConfig) -> None:
        """Health checks every interval_s, metrics every metrics_interval_s, until cancelled."""
        next_health = next_metrics = 0.0
        while True:
            now = time.monotonic()
            if now >= next_health:
                next_health = now + cfg.interval_s
                await self.check_health(client, cfg)
            if now >= next_metrics:
                next_metrics = now + cfg.metrics_interval_s
                if self.healthy:
                    await self.poll_metrics(client, cfg)
            await asyncio.sleep(max(0.0, min(next_health, next_metrics) - time.monotonic()))
