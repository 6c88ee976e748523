"""benchmarks/serve.py, the serving benchmark: its arrival process and its metrics on made-up
timings, then a short run against the real server."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from reliability_utils import API_KEY, wait_idle

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_arrivals_poisson_gamma_and_inf(bench):
    rng = np.random.default_rng(0)
    assert (bench.arrival_times(10, math.inf, 1.0, rng) == 0).all()
    for burstiness in (1.0, 0.25, 4.0):
        t = bench.arrival_times(20000, 5.0, burstiness, rng)
        gaps = np.diff(t)
        assert (gaps >= 0).all() and t[0] == 0
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)  # 1 / rate
        # Gamma gaps of shape k have a coefficient of variation of 1 / sqrt(k): 1 is Poisson.
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_metrics_on_known_timings(bench):
    R = bench.RequestResult
    results = [
        R(success=True, start=0.0, ttft=0.1, latency=1.1, itl=[0.5, 0.5], prompt_len=10, output_len=3,
          chunk_times=[0.1, 0.6, 1.1]),
        R(success=True, start=0.5, ttft=0.3, latency=0.3, itl=[], prompt_len=10, output_len=1, chunk_times=[0.8]),
        R(success=False, error="HTTP 503", start=0.6),
    ]
    slos = bench.parse_goodput(["ttft:200", "tpot:600"])
    m = bench.compute_metrics(results, duration=2.0, slos=slos, percentiles=[99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 4 and m["total_input_tokens"] == 20
    assert m["output_throughput"] == 2.0 and m["request_throughput"] == 1.0
    assert m["tpot_ms"]["mean"] == pytest.approx(500.0)  # (1.1 - 0.1) / (3 - 1); one-token requests have none
    assert m["ttft_ms"]["median"] == pytest.approx(200.0)
    assert m["itl_ms"]["mean"] == pytest.approx(500.0)
    assert m["request_goodput"] == 0.5  # only the first meets TTFT <= 200 ms
    assert m["max_concurrent_requests"] == 2
    assert m["max_output_tokens_per_s"] == 3  # chunks at 0.1, 0.6, 0.8 in the first second
    with pytest.raises(SystemExit):
        bench.parse_goodput(["latency:5"])


def test_short_run_against_the_server(bench, rel_server, tmp_path):
    wait_idle(rel_server)
    out = tmp_path / "result.json"
    metrics = bench.main([
        "--base-url", rel_server.url, "--api-key", API_KEY, "--num-prompts", "12", "--random-input-len", "32",
        "--random-output-len", "8", "--ignore-eos", "--request-rate", "50", "--max-concurrency", "4",
        "--goodput", "ttft:60000", "--result-json", str(out), "--quiet",
    ])
    assert metrics["completed"] == 12 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == 12 * 8 and metrics["total_input_tokens"] == 12 * 32
    assert metrics["request_goodput"] == pytest.approx(metrics["request_throughput"])
    assert 1 <= metrics["max_concurrent_requests"] <= 4
    saved = json.loads(out.read_text())
    assert saved["metrics"]["completed"] == 12 and len(saved["requests"]) == 12
    assert "api_key" not in saved["config"]
    assert all(r["ttft"] > 0 and r["latency"] >= r["ttft"] for r in saved["requests"])
    wait_idle(rel_server)
