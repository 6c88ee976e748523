"""Placement on Ray: the router starts its replica as a Ray actor (a local Ray cluster) running a
real pagedllm server, routes to it, and stops it on exit. Extended: a local Ray takes ~20 s and
~1 GiB to start (`pytest -m extended tests/router/test_router_ray.py`)."""

from __future__ import annotations

import pytest
import requests

from router_process import ROUTER_KEY, RouterProcess

pytest.importorskip("ray")


@pytest.mark.extended
def test_ray_placement_starts_routes_to_and_stops_replicas(tiny_llama, tmp_path):
    launch = {"model": tiny_llama, "num_cpus": 0,
              "args": ["--served-model-name", "ray-tiny", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
                       "--disable-log-stats"]}
    cfg = {"placement": "ray", "api_key": ROUTER_KEY,
           "tiers": [{"name": "edge", "backends": [{"models": ["ray-tiny"], "launch": launch}]}]}
    r = RouterProcess(cfg, str(tmp_path), "ray")
    r.wait_ready(timeout=300)
    try:
        resp = r.post("/v1/completions", {"model": "edge", "prompt": "Hello", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["model"] == "ray-tiny"
        url = r.backends()[0]["url"]
        assert requests.get(url + "/health", timeout=5).status_code == 200
    finally:
        assert r.stop(timeout=90) == 0, r.log_text()[-3000:]
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=5)
