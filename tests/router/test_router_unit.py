"""The router's pure parts, without servers: config validation (errors name the key), the
complexity score and tier choice, model-name resolution, the cascade's signal, the hash ring's
consistency, the circuit breaker's states, the metrics parser, and the simulator's queueing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pagedllm.router.backends import Backend, CircuitBreaker, parse_load_metrics
from pagedllm.router.balance import Balancer, HashRing
from pagedllm.router.config import BreakerConfig, PrefixAffinityConfig, router_config_from_dict
from pagedllm.router.features import complexity_score, extract_features, prefix_key, tier_index_for_score
from pagedllm.router.policy import Planner, RouteError, mean_logprob
from pagedllm.router.simulate import TierCurve, TraceRequest, simulate, single_tier_config, synthetic_trace


def three_tier_config(**route) -> dict:
    tiers = [{"name": n, "backends": [{"url": f"http://10.0.0.{i}:8000", "models": [f"{n}-model"]}]}
             for i, n in enumerate(("edge", "region", "center"), 1)]
    r = {"name": "auto", "models": ["auto"], "tiers": ["edge", "region", "center"], "policy": "features", **route}
    return {"tiers": tiers, "routes": [r]}


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["tiers"][0].update(bogus=1), "tiers[0]: unknown key(s) ['bogus']"),
    (lambda c: c["tiers"][1]["backends"][0].update(url="ftp://x"), "tiers[1].backends[0].url"),
    (lambda c: c["tiers"][0].update(timeout_s=0), "tiers[0].timeout_s: must be > 0"),
    (lambda c: c["routes"][0].update(tiers=["edge", "nowhere"]), "routes[0].tiers: unknown tier 'nowhere'"),
    (lambda c: c["routes"][0].update(balance="random"), "routes[0].balance: must be one of"),
    (lambda c: c["routes"][0].update(features={"thresholds": [0.5, 0.2]}), "routes[0].features.thresholds: must be ascending"),
    (lambda c: c["routes"][0].update(features={"thresholds": [0.5]}), "3 tiers need 2 thresholds"),
    (lambda c: c["routes"][0].update(features={"weights": {"vibes": 1.0}}), "unknown feature(s) ['vibes']"),
    (lambda c: c.update(port="80"), "port: expected an integer"),
    (lambda c: c["tiers"].append(dict(c["tiers"][0])), "duplicate tier names"),
])
def test_config_errors_name_the_key(mutate, message):
    cfg = three_tier_config()
    mutate(cfg)
    with pytest.raises(ValueError) as e:
        router_config_from_dict(cfg)
    assert message in str(e.value)


def test_tier_timeouts_come_from_the_slo():
    cfg = three_tier_config()
    cfg["tiers"][0].update(slo_ms=100)               # 10 x 100 ms is under the 1 s floor
    cfg["tiers"][1].update(slo_ms=300)
    cfg["tiers"][2].update(slo_ms=1000, timeout_s=4.5)
    tiers = router_config_from_dict(cfg).tiers
    assert [t.effective_timeout_s for t in tiers] == [1.0, 3.0, 4.5]
    assert router_config_from_dict(three_tier_config()).tiers[0].effective_timeout_s == 60.0


def test_complexity_score_orders_requests_and_picks_tiers():
    cfg = router_config_from_dict(three_tier_config())
    fc = cfg.routes[0].features
    simple = extract_features({"messages": [{"role": "user", "content": "Hi, what time is it?"}], "max_tokens": 20},
                              fc.keywords)
    code = "def f(x):\n    return x\n" * 40
    hard = extract_features({"messages": [{"role": "user", "content": "Analyze and optimize this algorithm step by "
                                           f"step:\n```python\n{code}```"}] * 3, "max_tokens": 1000}, fc.keywords)
    assert simple.turns == 1 and not simple.has_code and simple.keyword_hits == 0
    assert hard.turns == 3 and hard.has_code and hard.keyword_hits >= 3
    s_simple, s_hard = complexity_score(simple, fc), complexity_score(hard, fc)
    assert 0 <= s_simple < 0.05 and 0.6 < s_hard <= 1.0
    assert tier_index_for_score(s_simple, fc.thresholds, 3) == 0
    assert tier_index_for_score(s_hard, fc.thresholds, 3) == 2
    assert tier_index_for_score(0.3, fc.thresholds, 3) == 1
    # Token-id prompts are counted exactly.
    assert extract_features({"prompt": list(range(700))}, fc.keywords).prompt_tokens == 700


def test_planner_resolves_aliases_tiers_and_served_names():
    cfg = router_config_from_dict(three_tier_config(cascade={"min_mean_logprob": -1.0}))
    planner = Planner(cfg)
    served = {"edge-model": ["edge"], "center-model": ["center"]}
    plan = planner.plan({"model": "auto", "prompt": "hi"}, served)
    assert plan.tiers == ["edge", "region", "center"] and plan.cascade is not None and plan.served_model is None
    # A stream is never cascaded (it cannot be taken back).
    assert planner.plan({"model": "auto", "prompt": "hi", "stream": True}, served).cascade is None
    assert planner.plan({"model": "region"}, served).tiers == ["region"]
    p = planner.plan({"model": "center-model"}, served)
    assert p.tiers == ["center"] and p.served_model == "center-model"
    with pytest.raises(RouteError) as e:
        planner.plan({"model": "gpt-9"}, served)
    assert e.value.status_code == 404 and e.value.body()["error"]["code"] == "model_not_found"
    with pytest.raises(RouteError) as e:
        planner.plan({"prompt": "no model"}, served)
    assert e.value.status_code == 400 and e.value.param == "model"


def test_cascade_signal():
    cfg = router_config_from_dict(three_tier_config(cascade={"min_mean_logprob": -2.0, "escalate_on_truncation": True}))
    planner = Planner(cfg)
    plan = planner.plan({"model": "auto", "prompt": "x"}, {})
    confident = {"choices": [{"text": "Paris.", "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1, -0.3]}}]}
    unsure = {"choices": [{"text": "Maybe", "finish_reason": "stop", "logprobs": {"token_logprobs": [-3.0, -2.5]}}]}
    chat_unsure = {"choices": [{"message": {"content": "Hmm"}, "finish_reason": "stop",
                                "logprobs": {"content": [{"token": "H", "logprob": -4.0}]}}]}
    refusal = {"choices": [{"message": {"content": "I'm sorry, I can't help with that."}, "finish_reason": "stop"}]}
    cut = {"choices": [{"text": "The answer is", "finish_reason": "length"}]}
    assert planner.weak_answer(plan, confident) is None
    assert planner.weak_answer(plan, unsure) == "logprob"
    assert planner.weak_answer(plan, chat_unsure) == "logprob"
    assert planner.weak_answer(plan, refusal) == "refusal"
    assert planner.weak_answer(plan, cut) == "truncated"
    assert mean_logprob(unsure["choices"][0]) == pytest.approx(-2.75)
    assert planner.escalation(plan, "edge") == "region" and planner.escalation(plan, "center") is None


def test_prefix_key_and_ring_are_consistent():
    cfg = PrefixAffinityConfig(block_chars=16, num_blocks=2)
    shared = "You are a helpful assistant. " * 3
    assert prefix_key(shared + "question one", cfg) == prefix_key(shared + "another question", cfg)
    assert prefix_key("A" * 40, cfg) != prefix_key("B" * 40, cfg)
    ring = HashRing(virtual_nodes=64)
    urls3 = ("http://a", "http://b", "http://c")
    keys = [prefix_key(f"prefix {i} " * 10, cfg) for i in range(300)]
    owners3 = [ring.owner(k, urls3) for k in keys]
    assert len(set(owners3)) == 3 and min(owners3.count(u) for u in urls3) > 50
    # Taking b out moves only b's keys.
    owners2 = [ring.owner(k, ("http://a", "http://c")) for k in keys]
    assert all(o2 == o3 for o2, o3 in zip(owners2, owners3) if o3 != "http://b")


def test_balancer_least_load_and_affinity_bound():
    from pagedllm.router.config import BackendConfig

    bs = [Backend(BackendConfig(url=f"http://h{i}", models=("m",)), "t", BreakerConfig()) for i in range(3)]
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 5, 1, 3
    assert [b.url for b in Balancer("least_load", PrefixAffinityConfig()).order(bs, None)] == ["http://h1", "http://h2", "http://h0"]
    aff = Balancer("prefix_affinity", PrefixAffinityConfig(max_load_imbalance=2.0))
    key = next(k for k in range(10_000) if aff._ring.owner(k, tuple(sorted(b.url for b in bs))) == "http://h0")
    assert aff.order(bs, key)[0].url == "http://h1"   # the owner is 4 busier: least load wins
    bs[0].in_flight = 2
    assert aff.order(bs, key)[0].url == "http://h0"   # within the bound: the owner


def test_circuit_breaker_states():
    br = CircuitBreaker(BreakerConfig(failure_threshold=2, cooldown_s=10))
    assert br.allows(0)
    br.on_failure(1)
    assert br.state == "closed" and br.allows(1)
    br.on_failure(2)
    assert br.state == "open" and not br.allows(5)
    assert br.allows(12) and br.state == "half_open"   # one trial after the cooldown
    br.on_start()
    assert not br.allows(12)                           # only one
    br.on_failure(13)
    assert br.state == "open" and not br.allows(14)
    assert br.allows(23)
    br.on_start()
    br.on_success()
    assert br.state == "closed" and br.allows(23)


def test_parse_load_metrics_sums_label_sets():
    text = ('# HELP pagedllm:num_requests_running x\npagedllm:num_requests_running{model_name="a"} 3.0\n'
            'pagedllm:num_requests_waiting{model_name="a"} 2.0\nvllm:num_requests_waiting{model_name="b"} 1.0\n'
            'pagedllm:kv_cache_usage_perc{model_name="a"} 0.25\npagedllm:prefix_cache_hits_total{model_name="a"} 96.0\n')
    assert parse_load_metrics(text) == {"running": 3.0, "waiting": 3.0, "kv_usage": 0.25, "prefix_hits": 96.0}


def test_simulator_queues_and_tiers():
    cfg = router_config_from_dict(three_tier_config())
    flat = TierCurve(tpot_points=((1, 10.0), (4, 20.0)), ttft_base_ms=50.0, max_num_seqs=2, replicas=1)
    assert flat.tpot_ms(2) == pytest.approx(10 + 10 / 3) and flat.tpot_ms(100) == 20.0
    assert flat.service_ms(100, 11, 1) == pytest.approx(50 + 10 * 10)
    curves = {"edge": TierCurve(((1, 2.0),), 5.0, max_num_seqs=64, replicas=1, cost_per_hour=1.0),
              "region": TierCurve(((1, 5.0),), 20.0, max_num_seqs=64, replicas=1, cost_per_hour=2.0),
              "center": TierCurve(((1, 10.0), (64, 20.0)), 40.0, max_num_seqs=64, replicas=2, cost_per_hour=8.0)}
    trace = synthetic_trace(5.0, 400, {"simple": 0.6, "medium": 0.3, "complex": 0.1}, seed=1)
    tiered = simulate(cfg, curves, trace, route_model="auto")
    per_tier = {t["tier"]: t for t in tiered["tiers"]}
    assert sum(t["requests"] for t in tiered["tiers"]) == 400
    assert per_tier["edge"]["requests"] > per_tier["center"]["requests"] > 0
    base_cfg = single_tier_config(cfg, "center")
    base = simulate(base_cfg, {"center": curves["center"]}, [dataclasses.replace(r, model="all") for r in trace],
                    route_model="all")
    assert tiered["mean_ms"] < base["mean_ms"]
    # One slot and arrivals faster than service: the queue makes the later requests wait.
    one = {"edge": TierCurve(((1, 10.0),), 0.0, max_num_seqs=1, replicas=1)}
    edge_cfg = single_tier_config(cfg, "edge")
    burst = [TraceRequest(arrival_s=0.0, prompt_tokens=10, output_tokens=11, model="all") for _ in range(3)]
    assert simulate(edge_cfg, one, burst, route_model="all")["tiers"][0]["p99_ms"] == pytest.approx(300.0)


def test_flags_build_a_config_and_simulate_cli_runs(tmp_path):
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.router.cli import config_from_namespace

    ns = build_parser().parse_args(["router", "--backend", "edge=http://127.0.0.1:1=small",
                                    "--backend", "center=http://127.0.0.1:2/v1=big,huge", "--policy", "features"])
    cfg = config_from_namespace(ns)
    assert [t.name for t in cfg.tiers] == ["edge", "center"]
    assert cfg.tiers[1].backends[0].url == "http://127.0.0.1:2" and cfg.tiers[1].backends[0].models == ("big", "huge")
    assert cfg.routes[0].policy == "features" and cfg.default_model == "auto"
    import yaml

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(three_tier_config()))
    curves = {"tiers": {n: {"tpot_ms": [[1, v]], "ttft_ms": {"base": 10}, "cost_per_hour": v}
                        for n, v in (("edge", 2.0), ("region", 5.0), ("center", 10.0))}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(curves))
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "simulate", "--config",
                          str(tmp_path / "r.yaml"), "--curves", str(tmp_path / "c.yaml"), "--num-requests", "200",
                          "--baseline", "center", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["policy"]["requests"] == 200 and report["baseline"]["requests"] == 200
    assert report["mean_latency_ratio"] < 1.0
