"""`pagedllm router` (serve the gateway) and `pagedllm router simulate` (replay a trace).

    pagedllm router --config router.yaml
    pagedllm router --backend edge=http://127.0.0.1:8001 --backend center=http://127.0.0.1:8002=big \\
        --policy features --balance least_load --port 8080
    pagedllm router simulate --config sim.yaml [--trace trace.jsonl] [--json]

`--backend TIER=URL[=MODEL,MODEL...]` may repeat; tiers take the order of their first mention
(cheapest first); without models a backend's /v1/models is asked at startup. The flags build one
route, `auto`, over all tiers. Parsing imports no server package: `--help` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from pagedllm.router.config import BALANCE_POLICIES, TIER_POLICIES, RouterConfig, load_router_config, router_config_from_dict


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file with tiers, backends and routes (docs/router.md).")
    parser.add_argument("--host", default=None, help="Address to listen on (default 127.0.0.1).")
    parser.add_argument("--port", type=int, default=None, help="Port to listen on (default 8080).")
    parser.add_argument("--api-key", default=None,
                        help="Require `Authorization: Bearer KEY` on /v1 and /router; $PAGEDLLM_ROUTER_API_KEY when not given.")
    parser.add_argument("--backend", action="append", default=[], metavar="TIER=URL[=MODEL,...]",
                        help="A backend of a tier (repeatable), when no --config is given.")
    parser.add_argument("--policy", choices=TIER_POLICIES, default="first",
                        help="How the flags' `auto` route picks a tier: first (the cheapest) or features (complexity score).")
    parser.add_argument("--balance", choices=BALANCE_POLICIES, default="least_load", help="Replica choice inside a tier.")
    parser.add_argument("--cascade-min-logprob", type=float, default=None,
                        help="Escalate a plain answer to the next tier when its mean token logprob is below this.")
    parser.add_argument("--timeout", type=float, default=None,
                        help="Per-tier timeout in seconds for the flags' tiers (to the first byte); default 60.")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    sub = parser.add_subparsers(dest="router_command", metavar="SUBCOMMAND")
    sim = sub.add_parser("simulate", help="Replay a trace through a policy: latency and cost per tier.",
                         description="Replay a trace (arrival times, prompt and output lengths) through the "
                         "config's routing policy and per-tier latency curves; report mean / P99 latency and cost per tier.")
    from pagedllm.router.simulate import add_simulate_args

    add_simulate_args(sim)


def _backend_flag(value: str) -> tuple[str, dict[str, Any]]:
    tier, sep, rest = value.partition("=")
    if not sep or not tier or not rest:
        raise ValueError(f"--backend: expected TIER=URL[=MODEL,...], got {value!r}")
    url, _, models = rest.partition("=")
    entry: dict[str, Any] = {"url": url}
    if models:
        entry["models"] = [m for m in models.split(",") if m]
    return tier, entry


def config_from_namespace(ns: argparse.Namespace) -> RouterConfig:
    overrides = {"host": ns.host, "port": ns.port, "api_key": ns.api_key or os.environ.get("PAGEDLLM_ROUTER_API_KEY")}
    if ns.config:
        if ns.backend:
            raise ValueError("--backend: give backends in the --config file or as flags, not both")
        return load_router_config(ns.config, overrides)
    if not ns.backend:
        raise ValueError("give --config FILE or at least one --backend TIER=URL")
    tiers: dict[str, list[dict[str, Any]]] = {}
    for value in ns.backend:
        tier, entry = _backend_flag(value)
        tiers.setdefault(tier, []).append(entry)
    names = list(tiers)
    route: dict[str, Any] = {"name": "auto", "models": ["auto"], "tiers": names, "policy": ns.policy,
                             "balance": ns.balance}
    if ns.policy == "features":
        route["features"] = {"thresholds": [round((i + 1) / len(names), 3) for i in range(len(names) - 1)]}
    if ns.cascade_min_logprob is not None:
        route["cascade"] = {"min_mean_logprob": ns.cascade_min_logprob}
    data = {"tiers": [{"name": n, "backends": bs, "timeout_s": ns.timeout} for n, bs in tiers.items()],
            "routes": [route], "default_model": "auto"}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return router_config_from_dict(data)


def run_router(ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    if ns.router_command == "simulate":
        from pagedllm.router.simulate import run_simulate

        return run_simulate(ns)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%m-%d %H:%M:%S",
                        stream=sys.stderr, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call otherwise
    try:
        cfg = config_from_namespace(ns)
    except (ValueError, OSError) as e:
        if parser is not None:
            parser.print_usage(sys.stderr)
        print(f"pagedllm router: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from pagedllm.router.gateway import Router

    placement = None
    if cfg.placement == "ray":
        from pagedllm.router.ray_placement import RayPlacement

        placement = RayPlacement(cfg)
        cfg = placement.start()
    try:
        app = Router(cfg)
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, log_level=ns.log_level,
                                access_log=False, lifespan="on", timeout_keep_alive=5)
        server = uvicorn.Server(config)
        # uvicorn re-raises SIGTERM / SIGINT after its graceful stop: end with 0 then.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: None)
        logging.getLogger(__name__).info(
            "router on http://%s:%d: tiers %s, routes %s", cfg.host, cfg.port,
            [f"{t.name}({len(t.backends)})" for t in cfg.tiers], [r.name for r in cfg.routes])
        server.run()
        return 0 if server.started else 1
    finally:
        if placement is not None:
            placement.stop()
