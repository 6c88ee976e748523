"""The router against three real pagedllm servers on loopback (tiny random Llama, served as
edge-model / region-model / center-model; tests/router/conftest.py) and real router processes:
routing by model name and by features, the cascade, streaming identical to direct and not
buffered, least load, prefix affinity measured from the backends' own prefix-cache counters,
Retry-After, client disconnects reaching the backend, timeouts and health ejection, and a
backend killed mid-burst. The kill test runs last (it takes the region server down)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import requests

from router_process import ROUTER_KEY, RouterProcess, backend_metric, metric_sum, wait_for

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def tier(name: str, *urls_models: tuple[str, str], **kw) -> dict:
    return {"name": name, "backends": [{"url": u, "models": [m]} for u, m in urls_models], **kw}


@pytest.fixture(scope="module")
def urls(tier_servers) -> dict[str, str]:
    return {name: s.url for name, s in tier_servers.items()}


@pytest.fixture(scope="module")
def router(urls, tmp_path_factory):
    edge, region, center = (urls["edge"], "edge-model"), (urls["region"], "region-model"), (urls["center"], "center-model")
    cfg = {
        "api_key": ROUTER_KEY,
        "health": {"interval_s": 0.5, "metrics_interval_s": 0.2},
        "tiers": [tier("edge", edge, slo_ms=100, timeout_s=60), tier("region", region, slo_ms=300, timeout_s=60),
                  tier("center", center, slo_ms=1000, timeout_s=60),
                  tier("pool", edge, region)],
        "routes": [
            {"name": "auto", "models": ["auto"], "tiers": ["edge", "region", "center"], "policy": "features",
             "features": {"thresholds": [0.1, 0.5], "weights": {"prompt_tokens": 0.2, "max_tokens": 0.1, "turns": 0.1,
                                                                 "code": 0.3, "keywords": 0.3}}},
            {"name": "cascade", "models": ["cascade"], "tiers": ["edge", "region", "center"],
             "cascade": {"min_mean_logprob": 0.0}},   # every real answer is below 0: always escalates
            {"name": "confident", "models": ["confident"], "tiers": ["edge", "region"],
             "cascade": {"min_mean_logprob": -1000.0}},
            {"name": "least-load", "models": ["pool-ll"], "tiers": ["pool"], "balance": "least_load"},
            {"name": "affinity", "models": ["pool-affinity"], "tiers": ["pool"], "balance": "prefix_affinity"},
            {"name": "round-robin", "models": ["pool-rr"], "tiers": ["pool"], "balance": "round_robin"},
            {"name": "center-first", "models": ["center-first"], "tiers": ["center", "region"]},
        ],
    }
    r = RouterProcess(cfg, str(tmp_path_factory.mktemp("router")), "main")
    r.wait_ready()
    yield r
    assert r.stop() == 0, r.log_text()[-3000:]
    assert not r.unhandled_errors(), r.unhandled_errors()


def client(url: str, key: str = ROUTER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_models_auth_and_errors(router):
    assert requests.get(router.url + "/v1/models", timeout=5).status_code == 401
    wrong = requests.get(router.url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ids = [m.id for m in client(router.url).models.list().data]
    for name in ("auto", "cascade", "edge", "center", "edge-model", "region-model", "center-model"):
        assert name in ids
    r = router.post("/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(router.url + "/v1/completions", data=b"{not json", headers=router.headers(), timeout=5)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # The backend's own 400 comes back as it is, and is not retried.
    r = router.post("/v1/completions", {"model": "edge-model", "prompt": "x", "max_tokens": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.headers["x-pagedllm-router-attempts"] == "1"
    assert requests.get(router.url + "/health", timeout=5).status_code == 200


def test_model_name_routing(router):
    c = client(router.url)
    for name, tier_name in (("center-model", "center"), ("edge-model", "edge"), ("region", "region"), ("edge", "edge")):
        raw = c.completions.with_raw_response.create(model=name, prompt="Hello", max_tokens=4)
        assert raw.parse().model == f"{tier_name}-model"
        assert raw.headers["x-pagedllm-router-tier"] == tier_name


def test_feature_routing(router):
    c = client(router.url)
    code = "def add(a, b):\n    return a + b\n"
    cases = {
        "edge-model": [{"role": "user", "content": "Hi! How are you today?"}],
        "region-model": [{"role": "user", "content": "Compare tea and coffee, and explain why people like them."}],
        "center-model": [{"role": "user", "content": "Debug this algorithm."},
                         {"role": "assistant", "content": "Sure."},
                         {"role": "user", "content": f"Analyze and optimize it step by step:\n```python\n{code}```"}],
    }
    for expected, messages in cases.items():
        got = c.chat.completions.create(model="auto", messages=messages, max_tokens=4)
        assert got.model == expected, (expected, messages)
    text = router.metrics()
    for t in ("edge", "region", "center"):
        assert metric_sum(text, "pagedllm:router_requests_total", route="auto", tier=t, code="200") >= 1


def test_cascade_escalates_when_forced(router):
    raw = router.post("/v1/completions", {"model": "cascade", "prompt": "Tell me something", "max_tokens": 4})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["model"] == "center-model" and raw.headers["x-pagedllm-router-escalations"] == "2"
    assert body["choices"][0]["logprobs"] is None   # asked for the signal, not shown to a client that did not
    chat = router.post("/v1/chat/completions", {"model": "cascade", "max_tokens": 4, "logprobs": True,
                                                "messages": [{"role": "user", "content": "Hello"}]}).json()
    assert chat["model"] == "center-model" and chat["choices"][0]["logprobs"]["content"]  # asked for: kept
    stays = router.post("/v1/completions", {"model": "confident", "prompt": "Tell me something", "max_tokens": 4})
    assert stays.json()["model"] == "edge-model" and stays.headers["x-pagedllm-router-escalations"] == "0"
    text = router.metrics()
    assert metric_sum(text, "pagedllm:router_escalations_total", route="cascade", from_tier="edge", to_tier="region",
                      reason="logprob") == 2
    assert metric_sum(text, "pagedllm:router_escalations_total", route="cascade", from_tier="region") == 2
    assert metric_sum(text, "pagedllm:router_escalations_total", route="confident") == 0


def _stream(c: openai.OpenAI, chat: bool, model: str, max_tokens: int) -> tuple[dict, list[float]]:
    """A greedy stream's tokens (from their logprobs), text and finish reason; chunk arrival times."""
    extra = {"ignore_eos": True}
    tokens, text, finish, times = [], "", None, []
    if chat:
        stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count with me"}],
                                           max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
                                           extra_body=extra)
    else:
        stream = c.completions.create(model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                                      stream=True, logprobs=0, extra_body=extra)
    for chunk in stream:
        times.append(time.monotonic())
        ch = chunk.choices[0]
        text += (ch.delta.content if chat else ch.text) or ""
        if ch.logprobs is not None:
            tokens += [e.token for e in ch.logprobs.content] if chat else ch.logprobs.tokens
        finish = ch.finish_reason or finish
    return {"tokens": tokens, "text": text, "finish_reason": finish}, times


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_through_the_router_is_token_identical(router, urls, chat):
    direct, _ = _stream(client(urls["region"], "none"), chat, "region-model", 24)
    routed, _ = _stream(client(router.url), chat, "region-model", 24)
    assert routed == direct
    assert len(direct["tokens"]) == 24 and direct["finish_reason"] == "length"


def test_streaming_is_not_buffered(router, urls):
    _, direct = _stream(client(urls["edge"], "none"), False, "edge-model", 300)
    _, routed = _stream(client(router.url), False, "edge-model", 300)
    span_direct, span_routed = direct[-1] - direct[0], routed[-1] - routed[0]
    assert span_direct > 0.1, span_direct
    # Chunks reach the client as the backend makes them, not all at once at the end (a buffered
    # stream would arrive within a few milliseconds).
    assert span_routed > max(0.1, 0.25 * span_direct), (span_routed, span_direct)
    assert len({round(t, 3) for t in routed}) > 20


def _hold_streams(url: str, model: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    def run() -> None:  # one long stream after another until `stop`
        while not stop.is_set():
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "model": model, "prompt": "busy", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=run, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _pool_entry(router: RouterProcess, url: str) -> dict:
    return next(b for b in router.backends() if b["tier"] == "pool" and b["url"] == url)


def test_least_load_spreads_a_burst(router, urls):
    def burst(n: int) -> list[str]:
        with ThreadPoolExecutor(n) as ex:
            return list(ex.map(lambda i: router.post("/v1/completions", {
                "model": "pool-ll", "prompt": f"burst {i}", "max_tokens": 48, "ignore_eos": True}).json()["model"],
                range(n)))

    models = burst(8)
    assert models.count("edge-model") >= 3 and models.count("region-model") >= 3, models

    def running(name: str) -> float:
        return _pool_entry(router, urls[name])["load"]["running"]

    wait_for(lambda: running("edge") == running("region") == 0, 30, "the burst's end in the metrics")
    # Load edge from outside the router: its /metrics shows it, and the burst goes to region.
    stop = threading.Event()
    threads = _hold_streams(urls["edge"], "edge-model", 4, stop)
    try:
        wait_for(lambda: running("edge") >= 4, 30, "edge's load in its metrics")
        before = [b for b in router.backends() if b["tier"] == "pool"]
        models = burst(6)
        assert models.count("region-model") >= 4, (models, before)
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def _prefix_workload(seed: int) -> list[str]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
    prompts = [f"{p}\nQuestion {j}: {rng.choice(WORDS)}?" for p in prefixes for j in range(5)]
    rng.shuffle(prompts)
    return prompts


def _hit_rate(router: RouterProcess, urls: dict[str, str], model: str, prompts: list[str]) -> float:
    def totals() -> tuple[float, float]:
        hits = sum(backend_metric(urls[n], "pagedllm:prefix_cache_hits_total") for n in ("edge", "region"))
        queries = sum(backend_metric(urls[n], "pagedllm:prefix_cache_queries_total") for n in ("edge", "region"))
        return hits, queries

    h0, q0 = totals()
    for p in prompts:
        r = router.post("/v1/completions", {"model": model, "prompt": p, "max_tokens": 1})
        assert r.status_code == 200, r.text
    time.sleep(0.3)
    h1, q1 = totals()
    assert q1 > q0
    return (h1 - h0) / (q1 - q0)


def test_prefix_affinity_raises_the_prefix_cache_hit_rate(router, urls):
    rr = _hit_rate(router, urls, "pool-rr", _prefix_workload(seed=1))
    affinity = _hit_rate(router, urls, "pool-affinity", _prefix_workload(seed=2))
    assert affinity > rr + 0.1, (affinity, rr)


def test_retry_after_is_honoured(router, urls):
    stop = threading.Event()
    threads = _hold_streams(urls["center"], "center-model", 1, stop)   # center takes one request, queues none
    try:
        wait_for(lambda: backend_metric(urls["center"], "pagedllm:num_requests_running") >= 1, 30, "center busy")
        # center answers 503 + Retry-After: the route's next tier answers instead.
        r = router.post("/v1/completions", {"model": "center-first", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "region-model"
        assert r.headers["x-pagedllm-router-attempts"] == "2"
        center = next(b for b in router.backends() if b["tier"] == "center")
        assert center["retry_after_s"] > 0 and not center["available"]
        # Only center serves center-model: a clean 503 with Retry-After, in OpenAI's shape.
        r = router.post("/v1/completions", {"model": "center-model", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "server_error"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert "busy_503" in router.metrics()


def test_client_disconnect_aborts_the_backend_request(router, urls):
    def aborted() -> float:
        return backend_metric(urls["edge"], "pagedllm:request_success_total", finished_reason="abort")

    before = aborted()
    with httpx.stream("POST", router.url + "/v1/completions", headers=router.headers(), timeout=60, json={
            "model": "edge-model", "prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        it = r.iter_bytes()
        next(it)
        next(it)
    wait_for(lambda: aborted() >= before + 1, 10, "the streamed request aborted at the backend")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", headers=router.headers(), timeout=0.5, json={
            "model": "edge-model", "prompt": "go", "max_tokens": 1000, "ignore_eos": True})
    wait_for(lambda: aborted() >= before + 2, 10, "the plain request aborted at the backend")
    wait_for(lambda: all(b["in_flight"] == 0 for b in router.backends()), 10, "no request left in flight at the router")


def test_timeout_retry_ejection_and_return(urls, tier_servers, tmp_path_factory):
    edge, region = (urls["edge"], "edge-model"), (urls["region"], "region-model")
    route = {"name": "edge-first", "models": ["edge-first"], "tiers": ["edge", "region"]}
    tmp = str(tmp_path_factory.mktemp("router_faults"))
    slow = RouterProcess({"api_key": ROUTER_KEY, "health": {"interval_s": 60}, "routes": [route],
                          "tiers": [tier("edge", edge, timeout_s=1.0), tier("region", region)]}, tmp, "slow").wait_ready()
    watch = RouterProcess({"api_key": ROUTER_KEY, "routes": [route],
                           "health": {"interval_s": 0.25, "timeout_s": 0.5, "unhealthy_threshold": 1},
                           "tiers": [tier("edge", edge), tier("region", region)]}, tmp, "watch").wait_ready()
    proc = tier_servers["edge"].proc
    try:
        os.kill(proc.pid, signal.SIGSTOP)   # edge hangs: accepts connections, answers nothing
        t0 = time.monotonic()
        r = slow.post("/v1/completions", {"model": "edge-first", "prompt": "hi", "max_tokens": 2})
        elapsed = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["model"] == "region-model"
        assert r.headers["x-pagedllm-router-attempts"] == "2" and 1.0 <= elapsed < 20, elapsed
        assert metric_sum(slow.metrics(), "pagedllm:router_retries_total", tier="edge", reason="timeout") == 1
        wait_for(lambda: not next(b for b in watch.backends() if b["tier"] == "edge")["healthy"], 10, "edge ejected")
        r = watch.post("/v1/completions", {"model": "edge-first", "prompt": "hi", "max_tokens": 2})
        assert r.json()["model"] == "region-model" and r.headers["x-pagedllm-router-attempts"] == "1"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_for(lambda: next(b for b in watch.backends() if b["tier"] == "edge")["healthy"], 15, "edge back in rotation")
    r = watch.post("/v1/completions", {"model": "edge-first", "prompt": "hi", "max_tokens": 2})
    assert r.json()["model"] == "edge-model"
    for rp in (slow, watch):
        assert rp.stop() == 0


def test_killing_a_backend_mid_burst_loses_no_request(urls, tier_servers, tmp_path_factory):
    """Last in the module: it kills the region server."""
    edge, region = (urls["edge"], "edge-model"), (urls["region"], "region-model")
    r = RouterProcess({"api_key": ROUTER_KEY, "health": {"interval_s": 30},
                       "breaker": {"failure_threshold": 1, "cooldown_s": 60},
                       "tiers": [tier("pool", edge, region)],
                       "routes": [{"name": "pool", "models": ["pool"], "tiers": ["pool"]}]},
                      str(tmp_path_factory.mktemp("router_kill")), "kill").wait_ready()

    def plain(i: int) -> tuple[int, str]:
        resp = r.post("/v1/completions", {"model": "pool", "prompt": f"req {i}", "max_tokens": 150, "ignore_eos": True})
        return resp.status_code, resp.json().get("model", resp.text)

    def streamed(i: int) -> str:
        text = ""
        with httpx.stream("POST", r.url + "/v1/completions", headers=r.headers(), timeout=60, json={
                "model": "pool", "prompt": f"s {i}", "max_tokens": 150, "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_text():
                text += chunk
        return text

    try:
        with ThreadPoolExecutor(16) as ex:
            plains = [ex.submit(plain, i) for i in range(12)]
            streams = [ex.submit(streamed, i) for i in range(4)]
            time.sleep(0.5)
            tier_servers["region"].proc.kill()
            results = [f.result(timeout=90) for f in plains]
            texts = [f.result(timeout=90) for f in streams]
        assert all(code == 200 for code, _ in results), results
        assert {m for _, m in results} <= {"edge-model", "region-model"}
        for text in texts:   # finished, or ended with a clean error event: never hung
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            assert '"finish_reason":"length"' in text or '"code": "upstream_failed"' in text
        after = [plain(i) for i in range(4)]
        assert after == [(200, "edge-model")] * 4
        text = r.metrics()
        assert metric_sum(text, "pagedllm:router_retries_total", tier="pool") >= 1
        assert metric_sum(text, "pagedllm:router_circuit_open", backend=urls["region"]) == 1
    finally:
        assert r.stop() == 0
