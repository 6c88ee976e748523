"""The router's own Prometheus metrics, in a registry of its own (two routers can live in one
process), under `pagedllm:router_*`:

    router_requests_total{route, tier, code}        answered requests (tier "none": never placed)
    router_escalations_total{route, from_tier, to_tier, reason}
    router_retries_total{tier, reason}              attempts that failed before the first byte
    router_request_latency_seconds{tier}            end-to-end, as the router saw it
    router_time_to_first_byte_seconds{tier}
    router_backend_up{tier, backend}                1 while in rotation
    router_backend_in_flight{tier, backend}
    router_circuit_open{tier, backend}
"""

from __future__ import annotations

from typing import Any

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedllm:router_requests", "Requests answered, by route, tier and status code.",
                                ["route", "tier", "code"], registry=r)
        self.escalations = Counter("pagedllm:router_escalations", "Cascade escalations to a higher tier.",
                                   ["route", "from_tier", "to_tier", "reason"], registry=r)
        self.retries = Counter("pagedllm:router_retries", "Attempts that failed before the first byte and were retried.",
                               ["tier", "reason"], registry=r)
        self.latency = Histogram("pagedllm:router_request_latency_seconds", "End-to-end latency through the router.",
                                 ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("pagedllm:router_time_to_first_byte_seconds", "Time to the first byte of the answer.",
                              ["tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.backend_up = Gauge("pagedllm:router_backend_up", "1 while the backend is in rotation.",
                                ["tier", "backend"], registry=r)
        self.backend_in_flight = Gauge("pagedllm:router_backend_in_flight", "Requests in flight to the backend.",
                                       ["tier", "backend"], registry=r)
        self.circuit_open = Gauge("pagedllm:router_circuit_open", "1 while the backend's circuit is open.",
                                  ["tier", "backend"], registry=r)

    def refresh_backends(self, backends: list[Any], now: float) -> None:
        for b in backends:
            self.backend_up.labels(b.tier, b.url).set(1.0 if b.available(now) else 0.0)
            self.backend_in_flight.labels(b.tier, b.url).set(b.in_flight)
            self.circuit_open.labels(b.tier, b.url).set(1.0 if b.breaker.state == "open" else 0.0)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
