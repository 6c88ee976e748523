"""The HTTP layer in-process (starlette's TestClient) over the fake engine: error shapes and
status codes, the guard middleware, logprob formatting, and what the client sees when the
engine fails."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import build_app

KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture()
def fake():
    return FakeEngine(max_model_len=64)


@pytest.fixture()
def http(fake):
    engine = AsyncLLMEngine(fake, max_num_seqs=4, max_queue_len=2)
    app = build_app(engine, served_model_names=["fake", "alias"], model_path="/models/fake", max_model_len=64,
                    vocab_size=64, api_key="sekrit", max_request_body_size=4096)
    with TestClient(app) as client:
        yield client
    engine.shutdown()


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completion_and_alias_name(http, fake):
    r = http.post("/v1/completions", json={"model": "alias", "prompt": "hello", "max_tokens": 3}, headers=KEY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "alias"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert body["choices"][0]["finish_reason"] == "length"


def test_completion_logprobs_shape(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 1}, headers=KEY)
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["token_logprobs"] == [-0.5] * 3
    assert all(len(top) == 1 for top in lp["top_logprobs"])
    assert lp["text_offset"] == [0, 1, 2]


def test_chat_stream_shape(http):
    r = http.post("/v1/chat/completions", headers=KEY, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3,
        "stream": True, "n": 2, "logprobs": True, "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    })
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = events[2:-2]
    for i in range(2):
        # A chunk carries whatever is new since the last one (one token or more).
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        entries = [e for c in mine for e in c["logprobs"]["content"]]
        assert len(entries) == 3 and all(len(e["top_logprobs"]) == 2 for e in entries)
        assert "".join(c["delta"]["content"] for c in mine) == "".join(e["token"] for e in entries)
        assert all("role" not in c["delta"] for c in mine)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("method,path,kwargs,status,code", [
    ("get", "/v1/models", {}, 401, "invalid_api_key"),
    ("get", "/v1/models", {"headers": {"Authorization": "Bearer sekrit2"}}, 401, "invalid_api_key"),
    ("get", "/v1/models", {"headers": {"Authorization": "bearer sekrit"}}, 200, None),
    ("get", "/v1/completions", {"headers": KEY}, 405, "method_not_allowed"),
    ("get", "/nope", {}, 404, "not_found"),
    ("post", "/v1/completions", {"headers": {**KEY, "Content-Length": "abc"}, "content": b"{}"}, 400, None),
    ("post", "/v1/completions", {"headers": KEY, "content": b"x" * 5000}, 413, "request_too_large"),
    ("post", "/v1/completions", {"headers": KEY, "json": {"prompt": "x", "model": "other"}}, 404, "model_not_found"),
    ("post", "/v1/completions", {"headers": KEY, "json": {"prompt": "x" * 64}}, 400, "context_length_exceeded"),
    ("post", "/v1/completions", {"headers": KEY, "json": {"prompt": "x", "logit_bias": {"one": 5}}}, 400, None),
    ("post", "/v1/completions", {"headers": KEY, "json": {"prompt": "x", "best_of": 3}}, 400, None),
    ("post", "/v1/chat/completions", {"headers": KEY, "json": {"messages": [{"role": "user"}],
                                                               "response_format": {"type": "xml"}}}, 400, None),
])
def test_error_statuses(http, method, path, kwargs, status, code):
    r = getattr(http, method)(path, **kwargs)
    assert r.status_code == status, r.text
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == code


def test_health_metrics_version_need_no_key(http):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json() == {"version": "0.1.0"}
    assert http.get("/metrics").status_code == 200


def test_chunked_body_is_replayed(http):
    def body():
        yield b'{"prompt": "hel'
        yield b'lo", "max_tokens": 2}'

    r = http.post("/v1/completions", content=body(), headers=KEY)
    assert r.status_code == 200, r.text


def test_engine_failure_is_a_server_error_and_the_server_recovers(http, fake):
    calls = {"n": 0}

    def fail_once(_):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")

    fake.step_hook = fail_once
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}, headers=KEY)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}, headers=KEY)
    assert r.status_code == 200  # the failure came earlier; this one streams fine
    assert sse_events(r.text)[-1] == "[DONE]"


def test_engine_failure_mid_stream_is_an_sse_error(http, fake):
    calls = {"n": 0}

    def fail_later(_):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")

    fake.step_hook = fail_later
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True}, headers=KEY)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"


def test_dead_engine_gives_503(http, fake):
    def fail(_):
        raise RuntimeError("step broke")

    def abort_fails(_):
        raise RuntimeError("abort broke")

    fake.step_hook = fail
    fake.abort_request = abort_fails
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}, headers=KEY)
    r = http.get("/health")
    assert r.status_code == 503
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}, headers=KEY)
    assert r.status_code == 503 and r.headers["Retry-After"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_unknown_field_is_a_400_naming_it_and_bookkeeping_fields_pass(http, path, body):
    for field, value in (("use_beam_search", True), ("functions", []), ("reasoning_effort", "low")):
        r = http.post(path, json={**body, field: value}, headers=KEY)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_field" and field in err["message"]
    r = http.post(path, json={**body, "metadata": {"team": "a"}, "store": False, "user": "u1"}, headers=KEY)
    assert r.status_code == 200, r.text
    # a replayed assistant message may carry the SDK's extra keys; they are not request fields
    if "messages" in body:
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "ok", "refusal": None, "annotations": []},
                   {"role": "user", "content": "again"}]
        assert http.post(path, json={**body, "messages": history}, headers=KEY).status_code == 200
