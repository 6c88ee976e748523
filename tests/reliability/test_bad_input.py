"""Bad input: malformed bodies, wrong types, missing fields, values out of range, prompts the
model cannot hold, broken messages, invalid UTF-8, oversized bodies, unknown models and routes,
missing or wrong API keys. Each gets a 4xx with OpenAI's error shape, and afterwards the server
still answers a normal request with the same text as before."""

from __future__ import annotations

import pytest
import requests

from reliability_utils import API_KEY, AUTH, BODY_LIMIT, MAX_MODEL_LEN, assert_healthy, wait_idle

pytestmark = pytest.mark.timeout(120)

NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
LONG_IDS = [100 + i % 1000 for i in range(MAX_MODEL_LEN + 10)]


def _chat(**fields) -> dict:
    return {"messages": USER, "max_tokens": 4, **fields}


def _cmpl(**fields) -> dict:
    return {"prompt": "x", "max_tokens": 4, **fields}


# (case id, method, path, body: dict | bytes | None, headers, expected status, expected param or None)
CASES = [
    # ---- the body itself
    ("invalid-json-truncated", "POST", CMPL, b'{"prompt": "x",', AUTH, 400, None),
    ("invalid-json-trailing-garbage", "POST", CMPL, b'{"prompt": "x"} trailing', AUTH, 400, None),
    ("invalid-json-single-quotes", "POST", CMPL, b"{'prompt': 'x'}", AUTH, 400, None),
    ("body-is-array", "POST", CMPL, b'[{"prompt": "x"}]', AUTH, 400, None),
    ("body-is-string", "POST", CMPL, b'"hello"', AUTH, 400, None),
    ("body-is-null", "POST", CMPL, b"null", AUTH, 400, None),
    ("body-empty", "POST", CMPL, b"", AUTH, 400, None),
    ("body-whitespace", "POST", CMPL, b"  \n ", AUTH, 400, None),
    ("invalid-utf8-body", "POST", CMPL, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', AUTH, 400, None),
    ("invalid-utf8-chat", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', AUTH, 400, None),
    ("lone-surrogate-prompt", "POST", CMPL, b'{"prompt": "abc\\ud800def", "max_tokens": 2}', AUTH, 400, "prompt"),
    ("lone-surrogate-chat", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', AUTH, 400, "messages.0.content"),
    ("lone-surrogate-in-key", "POST", CMPL, b'{"prompt": "x", "max_tokens": 2, "\\ud800": 1}', AUTH, 400, None),
    ("nan-temperature", "POST", CMPL, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', AUTH, 400,
     "temperature"),
    ("infinite-top-p", "POST", CMPL, b'{"prompt": "x", "max_tokens": 2, "top_p": Infinity}', AUTH, 400, "top_p"),
    ("deeply-nested-json", "POST", CMPL, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", AUTH, 400, None),
    # ---- completions: prompt
    ("missing-prompt", "POST", CMPL, {"max_tokens": 4}, AUTH, 400, "prompt"),
    ("prompt-number", "POST", CMPL, _cmpl(prompt=5), AUTH, 400, "prompt"),
    ("prompt-object", "POST", CMPL, _cmpl(prompt={"text": "x"}), AUTH, 400, "prompt"),
    ("prompt-mixed-list", "POST", CMPL, _cmpl(prompt=[1, "a"]), AUTH, 400, "prompt"),
    ("prompt-too-deep", "POST", CMPL, _cmpl(prompt=[[[1, 2]]]), AUTH, 400, "prompt"),
    ("prompt-empty-string", "POST", CMPL, _cmpl(prompt=""), AUTH, 400, "prompt"),
    ("prompt-empty-list", "POST", CMPL, _cmpl(prompt=[]), AUTH, 400, "prompt"),
    ("prompt-list-with-empty-ids", "POST", CMPL, _cmpl(prompt=[[1, 2], []]), AUTH, 400, "prompt"),
    ("token-id-out-of-vocab", "POST", CMPL, _cmpl(prompt=[1, 2, 10**9]), AUTH, 400, "prompt"),
    ("token-id-negative", "POST", CMPL, _cmpl(prompt=[1, -2]), AUTH, 400, "prompt"),
    ("token-id-float", "POST", CMPL, _cmpl(prompt=[1, 2.5]), AUTH, 400, "prompt"),
    ("token-id-huge-int", "POST", CMPL, _cmpl(prompt=[2**70]), AUTH, 400, "prompt"),
    ("prompt-ids-over-max-model-len", "POST", CMPL, _cmpl(prompt=LONG_IDS), AUTH, 400, "prompt"),
    ("prompt-text-over-max-model-len", "POST", CMPL, _cmpl(prompt="word " * 2000), AUTH, 400, "prompt"),
    ("prompt-plus-max-tokens-over-max-model-len", "POST", CMPL, _cmpl(max_tokens=MAX_MODEL_LEN), AUTH, 400,
     "max_tokens"),
    ("streamed-prompt-over-max-model-len", "POST", CMPL, _cmpl(prompt=LONG_IDS, stream=True), AUTH, 400, "prompt"),
    # ---- completions: sampling fields
    ("max-tokens-string", "POST", CMPL, _cmpl(max_tokens="5"), AUTH, 400, "max_tokens"),
    ("max-tokens-float", "POST", CMPL, _cmpl(max_tokens=5.5), AUTH, 400, "max_tokens"),
    ("max-tokens-bool", "POST", CMPL, _cmpl(max_tokens=True), AUTH, 400, "max_tokens"),
    ("max-tokens-negative", "POST", CMPL, _cmpl(max_tokens=-1), AUTH, 400, "max_tokens"),
    ("max-tokens-zero", "POST", CMPL, _cmpl(max_tokens=0), AUTH, 400, "max_tokens"),
    ("max-tokens-huge", "POST", CMPL, _cmpl(max_tokens=10**12), AUTH, 400, "max_tokens"),
    ("max-tokens-beyond-int64", "POST", CMPL, _cmpl(max_tokens=2**70), AUTH, 400, "max_tokens"),
    ("temperature-negative", "POST", CMPL, _cmpl(temperature=-0.5), AUTH, 400, "temperature"),
    ("temperature-huge", "POST", CMPL, _cmpl(temperature=1e9), AUTH, 400, "temperature"),
    ("temperature-string", "POST", CMPL, _cmpl(temperature="hot"), AUTH, 400, "temperature"),
    ("top-p-zero", "POST", CMPL, _cmpl(top_p=0), AUTH, 400, "top_p"),
    ("top-p-above-one", "POST", CMPL, _cmpl(top_p=1.5), AUTH, 400, "top_p"),
    ("top-k-below-minus-one", "POST", CMPL, _cmpl(top_k=-5), AUTH, 400, "top_k"),
    ("top-k-float", "POST", CMPL, _cmpl(top_k=2.5), AUTH, 400, "top_k"),
    ("min-p-negative", "POST", CMPL, _cmpl(min_p=-0.1), AUTH, 400, "min_p"),
    ("n-zero", "POST", CMPL, _cmpl(n=0), AUTH, 400, "n"),
    ("n-negative", "POST", CMPL, _cmpl(n=-3), AUTH, 400, "n"),
    ("n-too-large", "POST", CMPL, _cmpl(n=100000), AUTH, 400, "n"),
    ("logprobs-negative", "POST", CMPL, _cmpl(logprobs=-1), AUTH, 400, "logprobs"),
    ("logprobs-too-many", "POST", CMPL, _cmpl(logprobs=21), AUTH, 400, "logprobs"),
    ("stop-too-many-strings", "POST", CMPL, _cmpl(stop=[f"s{i}" for i in range(1000)]), AUTH, 400, "stop"),
    ("stop-empty-string", "POST", CMPL, _cmpl(stop=["ok", ""]), AUTH, 400, "stop"),
    ("stop-not-strings", "POST", CMPL, _cmpl(stop=[1, 2]), AUTH, 400, "stop"),
    ("stop-token-ids-negative", "POST", CMPL, _cmpl(stop_token_ids=[-1]), AUTH, 400, "stop_token_ids"),
    ("presence-penalty-out-of-range", "POST", CMPL, _cmpl(presence_penalty=5), AUTH, 400, "presence_penalty"),
    ("frequency-penalty-out-of-range", "POST", CMPL, _cmpl(frequency_penalty=-3), AUTH, 400,
     "frequency_penalty"),
    ("repetition-penalty-zero", "POST", CMPL, _cmpl(repetition_penalty=0), AUTH, 400, "repetition_penalty"),
    ("seed-negative", "POST", CMPL, _cmpl(seed=-2), AUTH, 400, "seed"),
    ("seed-beyond-int64", "POST", CMPL, _cmpl(seed=2**80), AUTH, 400, "seed"),
    ("min-tokens-above-max-tokens", "POST", CMPL, _cmpl(max_tokens=2, min_tokens=5), AUTH, 400, "min_tokens"),
    ("best-of-not-n", "POST", CMPL, _cmpl(best_of=3), AUTH, 400, "best_of"),
    ("suffix", "POST", CMPL, _cmpl(suffix="y"), AUTH, 400, "suffix"),
    ("logit-bias-not-a-token", "POST", CMPL, _cmpl(logit_bias={"five": 10}), AUTH, 400, "logit_bias"),
    ("stream-string", "POST", CMPL, _cmpl(stream="yes"), AUTH, 400, "stream"),
    ("stream-options-wrong-type", "POST", CMPL, _cmpl(stream=True, stream_options="usage"), AUTH, 400,
     "stream_options"),
    ("ignore-eos-string", "POST", CMPL, _cmpl(ignore_eos="true"), AUTH, 400, "ignore_eos"),
    ("unknown-model", "POST", CMPL, _cmpl(model="gpt-17"), AUTH, 404, "model"),
    ("model-as-path", "POST", CMPL, _cmpl(model="../../../etc/passwd"), AUTH, 404, "model"),
    ("model-not-string", "POST", CMPL, _cmpl(model=5), AUTH, 400, "model"),
    # ---- chat
    ("chat-missing-messages", "POST", CHAT, {"max_tokens": 4}, AUTH, 400, "messages"),
    ("chat-empty-messages", "POST", CHAT, {"messages": []}, AUTH, 400, "messages"),
    ("chat-messages-object", "POST", CHAT, {"messages": {"role": "user", "content": "x"}}, AUTH, 400, "messages"),
    ("chat-message-string", "POST", CHAT, {"messages": ["hello"]}, AUTH, 400, "messages.0"),
    ("chat-message-without-role", "POST", CHAT, {"messages": [{"content": "x"}]}, AUTH, 400, "messages.0.role"),
    ("chat-unknown-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, AUTH, 400,
     "messages.0.role"),
    ("chat-role-not-string", "POST", CHAT, {"messages": [{"role": 1, "content": "x"}]}, AUTH, 400,
     "messages.0.role"),
    ("chat-content-number", "POST", CHAT, {"messages": [{"role": "user", "content": 7}]}, AUTH, 400,
     "messages.0.content"),
    ("chat-content-image-part", "POST", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     AUTH, 400, "messages.0.content"),
    ("chat-content-part-not-object", "POST", CHAT, {"messages": [{"role": "user", "content": ["x"]}]}, AUTH, 400,
     "messages.0.content"),
    ("chat-max-completion-tokens-zero", "POST", CHAT, _chat(max_completion_tokens=0), AUTH, 400,
     "max_completion_tokens"),
    ("chat-max-completion-tokens-too-big", "POST", CHAT, _chat(max_completion_tokens=10**6), AUTH, 400,
     "max_completion_tokens"),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, _chat(top_logprobs=3), AUTH, 400, "top_logprobs"),
    ("chat-top-logprobs-too-many", "POST", CHAT, _chat(logprobs=True, top_logprobs=99), AUTH, 400, "top_logprobs"),
    ("chat-n-zero", "POST", CHAT, _chat(n=0), AUTH, 400, "n"),
    ("chat-temperature-out-of-range", "POST", CHAT, _chat(temperature=-1), AUTH, 400, "temperature"),
    ("chat-tools", "POST", CHAT, _chat(tools=[{"type": "function"}]), AUTH, 400, "tools"),
    ("chat-response-format-json-schema", "POST", CHAT, _chat(response_format={"type": "json_schema"}), AUTH, 400,
     "response_format"),
    ("chat-template-kwargs-wrong-type", "POST", CHAT, _chat(chat_template_kwargs=["x"]), AUTH, 400,
     "chat_template_kwargs"),
    ("chat-template-kwargs-overrides-template", "POST", CHAT,
     _chat(chat_template_kwargs={"chat_template": "/etc/passwd"}), AUTH, 400, "chat_template_kwargs"),
    ("chat-unknown-model", "POST", CHAT, _chat(model="nope"), AUTH, 404, "model"),
    # ---- authentication, size, routes
    ("no-api-key", "POST", CMPL, _cmpl(), {}, 401, None),
    ("wrong-api-key", "POST", CMPL, _cmpl(), {"Authorization": "Bearer wrong"}, 401, None),
    ("api-key-prefix", "POST", CMPL, _cmpl(), {"Authorization": f"Bearer {API_KEY[:-1]}"}, 401, None),
    ("api-key-longer", "POST", CMPL, _cmpl(), {"Authorization": f"Bearer {API_KEY}x"}, 401, None),
    ("api-key-wrong-scheme", "POST", CHAT, _chat(), {"Authorization": f"Basic {API_KEY}"}, 401, None),
    ("api-key-empty-bearer", "GET", "/v1/models", None, {"Authorization": "Bearer "}, 401, None),
    ("models-without-key", "GET", "/v1/models", None, {}, 401, None),
    ("body-over-limit", "POST", CMPL, _cmpl(prompt="x" * (BODY_LIMIT + 10)), AUTH, 413, None),
    ("unknown-route", "POST", "/v1/embeddings", _cmpl(), AUTH, 404, None),
    ("wrong-method", "GET", CMPL, None, AUTH, 405, None),
]


@pytest.fixture(scope="module")
def reference(rel_server) -> str:
    """The normal request's answer before any bad input."""
    wait_idle(rel_server)
    r = requests.post(rel_server.url + CMPL, json=NORMAL, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _send(url: str, method: str, body, headers: dict) -> requests.Response:
    if method == "GET":
        return requests.get(url, headers=headers, timeout=60)
    if isinstance(body, bytes):
        return requests.post(url, data=body, headers={**headers, "Content-Type": "application/json"}, timeout=60)
    return requests.post(url, json=body, headers=headers, timeout=60)


def test_cases_are_many():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,path,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_4xx_openai_error(rel_server, reference, name, method, path, body, headers, status, param):
    r = _send(rel_server.url + path, method, body, headers)
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:500]}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error" or status in (404, 405), err
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert err["code"] == "invalid_api_key" and r.headers.get("WWW-Authenticate") == "Bearer"
    if status == 413:
        assert err["code"] == "request_too_large"


def test_server_answers_normally_after_bad_input(rel_server, reference):
    assert_healthy(rel_server)
    for stream in (False, True):
        r = requests.post(rel_server.url + CMPL, json={**NORMAL, "stream": stream}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            import json

            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            text = "".join(c["text"] for ln in lines[:-1] for c in json.loads(ln)["choices"])
        else:
            text = r.json()["choices"][0]["text"]
        assert text == reference
    wait_idle(rel_server)
    assert rel_server.unhandled_errors() == []
