"""`pagedllm router`: an OpenAI-compatible gateway over tiers of OpenAI-compatible servers.

A separate service that talks to its backends over HTTP only (it never imports the engine or
torch): backends are grouped into tiers (edge / region / center in the founding document), and
routes pick a tier per request (by model name or alias, by request features, by a cascade that
escalates on low confidence) and a replica inside it (least load from the backends' /metrics,
prefix affinity by consistent hashing, round robin). Reliability (health checks, circuit
breakers, retries before the first byte, per-tier timeouts, Retry-After, client disconnects
passed on) lives in `backends.py` and `gateway.py`; `simulate.py` replays a trace through the
same policies offline.

    config.py     frozen dataclasses, loaded from YAML or flags, validated (ValueError names the key)
    features.py   request features and the cheap complexity score; prefix keys for affinity
    policy.py     a request -> a Plan (route, ordered tiers, cascade); the cascade's confidence signal
    balance.py    replica choice: least load, prefix affinity (hash ring), round robin
    backends.py   one backend's state: health, load from /metrics, circuit breaker, Retry-After
    gateway.py    the ASGI app: auth, proxying (streams passed through), retries, disconnects
    metrics.py    the router's own Prometheus metrics
    simulate.py   `pagedllm router simulate`: a trace through a policy, latency and cost per tier
    ray_placement.py  optional: start the configured replicas as Ray actors
    cli.py        `pagedllm router` and `pagedllm router simulate`
"""
