"""The real server (a subprocess serving a tiny random Llama) driven by the official `openai`
client, sync and async: completions, chat, streaming, n, stop, logprobs, usage, concurrency
against the offline LLM, disconnects, and /metrics."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import requests

from server_utils import API_KEY, TINY_MAX_MODEL_LEN

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def metric(server_url: str, name: str, labels: str | None = None) -> float:
    """The value of metric `name` (its first series, or the one whose labels are exactly `labels`)."""
    text = requests.get(server_url + "/metrics", timeout=10).text
    label_re = re.escape(labels) if labels is not None else "[^}]*"
    m = re.search(rf"^{re.escape(name)}\{{{label_re}\}} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def tokenizer_of(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_health_version_models(tiny_server, client):
    assert requests.get(tiny_server.url + "/health", timeout=5).status_code == 200
    assert requests.get(tiny_server.url + "/version", timeout=5).json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == TINY_MAX_MODEL_LEN


def test_completion_usage_counts(client, tiny_llama):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
    assert out.object == "text_completion" and out.model == "tiny"
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    n_prompt = len(tokenizer_of(tiny_llama).encode(prompt))
    assert out.usage.prompt_tokens == n_prompt
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == n_prompt + 12


def test_completion_stream_joins_to_non_streamed_text(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=20, **GREEDY)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_joins_to_non_streamed_text(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=16, **GREEDY)
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 16


def test_max_completion_tokens_and_default_chat_length(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5, **GREEDY
    )
    assert out.usage.completion_tokens == 5


def test_async_chat(async_client):
    async def go():
        async with async_client as c:
            out = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, **GREEDY
            )
            stream = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True, **GREEDY
            )
            parts = [ch.choices[0].delta.content or "" async for ch in stream if ch.choices]
            return out, "".join(parts)

    out, streamed = asyncio.run(go())
    assert streamed == out.choices[0].message.content


def test_n2(client):
    greedy = client.completions.create(model="tiny", prompt="Pick a number:", n=2, max_tokens=8, **GREEDY)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy samples agree
    assert greedy.usage.completion_tokens == 16
    sampled = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Pick a number"}], n=2, max_tokens=8,
        temperature=1.0, seed=7, extra_body={"ignore_eos": True},
    )
    assert [c.index for c in sampled.choices] == [0, 1]
    assert sampled.usage.completion_tokens == 16
    streamed = list(client.completions.create(model="tiny", prompt="Pick a number:", n=2, max_tokens=8,
                                              stream=True, **GREEDY))
    for i in range(2):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) == greedy.choices[i].text


def test_stop_string(client):
    base = client.completions.create(model="tiny", prompt="Lists:", max_tokens=24, **GREEDY).choices[0].text
    # A stop string taken from the middle of the greedy text: the output ends right before its
    # first occurrence.
    words = [w for w in re.findall(r"\w{3,}", base)]
    assert words, base
    stop = words[len(words) // 2][:3]
    expected = base[: base.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="tiny", prompt="Lists:", max_tokens=24, stop=[stop],
                                                    stream=True, **GREEDY))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(model="tiny", prompt="Lists:", max_tokens=24, stop=stop, **GREEDY)
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert text == expected
        assert reason == "stop"


def test_completion_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    if not any("\ufffd" in t for t in lp.tokens):  # a token may be part of a UTF-8 character
        assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 4 and token in top
        assert top[token] == pytest.approx(max(top.values()), abs=1e-5)  # greedy took the best


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True,
        top_logprobs=2, **GREEDY,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    if not any("\ufffd" in e.token for e in content):
        assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert e.bytes == list(e.token.encode())
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True,
        top_logprobs=2, stream=True, **GREEDY,
    ))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_echo_and_multiple_prompts(client, tiny_llama):
    tok = tokenizer_of(tiny_llama)
    out = client.completions.create(model="tiny", prompt="Echo me", max_tokens=4, echo=True, **GREEDY)
    assert out.choices[0].text.startswith("Echo me") and len(out.choices[0].text) > len("Echo me")
    ids = tok.encode("A list of token ids")
    out = client.completions.create(model="tiny", prompt=["first prompt", "second prompt"], max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(model="tiny", prompt="second prompt", max_tokens=3, **GREEDY)
    assert out.choices[1].text == single.choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=3, **GREEDY)
    by_text = client.completions.create(model="tiny", prompt="A list of token ids", max_tokens=3, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_32_concurrent_streams_match_offline_llm(async_client, tiny_llama):
    from pagedllm import LLM, SamplingParams

    prompts = [f"Request number {i}: tell me about {w}" for i, w in
               enumerate(["cats", "the sea", "rust", "mountains"] * 8)]
    max_tokens = [8 + (i * 5) % 25 for i in range(32)]

    async def one(c, prompt, n):
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True, **GREEDY)
        parts, reasons = [], []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        return "".join(parts), reasons[-1]

    async def go():
        async with async_client as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, max_tokens)))

    results = asyncio.run(go())
    llm = LLM(model=tiny_llama, max_model_len=TINY_MAX_MODEL_LEN, kv_cache_memory="64MiB")
    offline = llm.generate(
        prompts, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in max_tokens], use_tqdm=False
    )
    for (text, reason), expected in zip(results, offline):
        assert reason == "length"
        assert text == expected.outputs[0].text


def test_client_disconnect_frees_kv_cache(client, tiny_server):
    stream = client.completions.create(model="tiny", prompt="Tell me a long story", max_tokens=400, stream=True, **GREEDY)
    it = iter(stream)
    for _ in range(3):
        next(it)
    assert metric(tiny_server.url, "pagedllm:kv_cache_usage_perc") > 0
    assert metric(tiny_server.url, "pagedllm:num_requests_running") == 1
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(tiny_server.url, "pagedllm:kv_cache_usage_perc") == 0 and \
                metric(tiny_server.url, "pagedllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(tiny_server.url, "pagedllm:kv_cache_usage_perc") == 0
    assert metric(tiny_server.url, "pagedllm:num_requests_running") == 0
    assert requests.get(tiny_server.url + "/health", timeout=5).status_code == 200


def test_non_streaming_disconnect_aborts(tiny_server):
    # A client that gives up on a long non-streamed request: the request is aborted. (It waits 0.1 s
    # for the answer: 500 tokens of the tiny model took under 0.5 s on an idle machine here.)
    aborted = ("pagedllm:request_success_total", 'finished_reason="abort",model_name="tiny"')
    before = metric(tiny_server.url, *aborted)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(
            tiny_server.url + "/v1/completions",
            json={"prompt": "Go on and on", "max_tokens": 500, "temperature": 0, "ignore_eos": True},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=(5, 0.1),
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric(tiny_server.url, "pagedllm:num_requests_running") != 0:
        time.sleep(0.1)
    assert metric(tiny_server.url, "pagedllm:num_requests_running") == 0
    assert metric(tiny_server.url, "pagedllm:kv_cache_usage_perc") == 0
    assert metric(tiny_server.url, *aborted) == before + 1, "the request finished instead of being aborted"


_AUTH = {"Authorization": f"Bearer {API_KEY}"}
_LONG_IDS = list(range(100, 100 + TINY_MAX_MODEL_LEN + 5))

# (name, path, body: dict | str | bytes, headers, expected status, expected error param or None)
BAD_INPUTS = [
    ("invalid JSON", "/v1/completions", b'{"prompt": "x",', _AUTH, 400, None),
    ("body not an object", "/v1/completions", b"[1, 2]", _AUTH, 400, None),
    ("empty body", "/v1/completions", b"", _AUTH, 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, _AUTH, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, _AUTH, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, _AUTH, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, _AUTH, 400, "prompt"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, _AUTH, 400, "max_tokens"),
    ("max_tokens bool", "/v1/completions", {"prompt": "x", "max_tokens": True}, _AUTH, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -1}, _AUTH, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, _AUTH, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -0.5}, _AUTH, 400, "temperature"),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, _AUTH, 400, "temperature"),
    ("top_p above 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, _AUTH, 400, "top_p"),
    ("top_k below -1", "/v1/completions", {"prompt": "x", "top_k": -3}, _AUTH, 400, "top_k"),
    ("min_p above 1", "/v1/completions", {"prompt": "x", "min_p": 2}, _AUTH, 400, "min_p"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, _AUTH, 400, "n"),
    ("presence_penalty out of range", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, _AUTH, 400,
     "presence_penalty"),
    ("repetition_penalty zero", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, _AUTH, 400,
     "repetition_penalty"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 50}, _AUTH, 400, "logprobs"),
    ("stop wrong type", "/v1/completions", {"prompt": "x", "stop": 5}, _AUTH, 400, "stop"),
    ("seed negative", "/v1/completions", {"prompt": "x", "seed": -2}, _AUTH, 400, "seed"),
    ("min_tokens above max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, _AUTH,
     400, "min_tokens"),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [1, 2, 10**9]}, _AUTH, 400, "prompt"),
    ("token id negative", "/v1/completions", {"prompt": [1, -2]}, _AUTH, 400, "prompt"),
    ("prompt longer than max_model_len", "/v1/completions", {"prompt": _LONG_IDS}, _AUTH, 400, "prompt"),
    ("prompt + max_tokens beyond max_model_len", "/v1/completions",
     {"prompt": "x", "max_tokens": TINY_MAX_MODEL_LEN}, _AUTH, 400, "max_tokens"),
    ("unsupported suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, _AUTH, 400, "suffix"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, _AUTH, 404, "model"),
    ("no api key", "/v1/completions", {"prompt": "x"}, {}, 401, None),
    ("wrong api key", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer nope"}, 401, None),
    ("wrong auth scheme", "/v1/models", None, {"Authorization": f"Basic {API_KEY}"}, 401, None),
    ("body over the limit", "/v1/completions", {"prompt": "x" * (1 << 20)}, _AUTH, 413, None),
    ("unknown route", "/v1/nothing", {"prompt": "x"}, _AUTH, 404, None),
    ("chat without messages", "/v1/chat/completions", {"model": "tiny"}, _AUTH, 400, "messages"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, _AUTH, 400, "messages"),
    ("chat content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, _AUTH,
     400, "messages.0.content"),
    ("chat image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, _AUTH,
     400, "messages.0.content"),
    ("chat top_logprobs too many", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, _AUTH, 400,
     "top_logprobs"),
    ("chat max_completion_tokens too big", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, _AUTH, 400,
     "max_completion_tokens"),
    ("chat unknown model", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     _AUTH, 404, "model"),
    ("chat tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, _AUTH, 400, "tools"),
    ("stream wrong type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, _AUTH, 400, "stream"),
    ("streamed prompt too long", "/v1/completions", {"prompt": _LONG_IDS, "stream": True}, _AUTH, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(tiny_server, name, path, body, headers, status, param):
    url = tiny_server.url + path
    if body is None:
        r = requests.get(url, headers=headers, timeout=30)
    elif isinstance(body, bytes):
        r = requests.post(url, data=body, headers={**headers, "Content-Type": "application/json"}, timeout=30)
    else:
        r = requests.post(url, json=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert err["code"] == "invalid_api_key"


def test_server_healthy_after_bad_inputs(tiny_server, client):
    assert requests.get(tiny_server.url + "/health", timeout=5).status_code == 200
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=3, **GREEDY).choices[0].text
    # The model field may be left out; the key is not needed outside /v1.
    r = requests.post(tiny_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=_AUTH,
                      timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert requests.get(tiny_server.url + "/metrics", timeout=5).status_code == 200


def test_chunked_body_over_limit_is_413(tiny_server):
    def body():
        for _ in range(300):
            yield b"x" * 4096

    r = requests.post(tiny_server.url + "/v1/completions", data=body(), headers=_AUTH, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_metrics_carry_vllm_names(tiny_server, client):
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=4, **GREEDY)
    text = requests.get(tiny_server.url + "/metrics", timeout=5).text
    for name in [
        "pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:num_requests_swapped",
        "pagedllm:kv_cache_usage_perc", "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
        "pagedllm:num_preemptions_total", "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
        "pagedllm:request_success_total", "pagedllm:time_to_first_token_seconds_bucket",
        "pagedllm:time_per_output_token_seconds_bucket", "pagedllm:inter_token_latency_seconds_bucket",
        "pagedllm:e2e_request_latency_seconds_bucket", "pagedllm:request_queue_time_seconds_bucket",
        "pagedllm:request_prompt_tokens_bucket", "pagedllm:request_generation_tokens_bucket",
    ]:
        assert re.search(rf"^{re.escape(name)}\{{", text, re.MULTILINE), name
    assert 'model_name="tiny"' in text
    assert metric(tiny_server.url, "pagedllm:generation_tokens_total") >= 4
    assert metric(tiny_server.url, "pagedllm:e2e_request_latency_seconds_count") >= 1
    length = re.search(r'^pagedllm:request_success_total\{finished_reason="length",model_name="tiny"\} (\S+)$', text,
                       re.MULTILINE)
    assert length and float(length.group(1)) >= 1
