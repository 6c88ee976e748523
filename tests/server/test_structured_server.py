"""Structured outputs, tool calls and the rest of the OpenAI surface, through a real server
and the real `openai` client: on the tiny random model (only the constraint can make the
output valid) and on the embedded SmolLM2 with the hermes tool parser (greedy)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests
from pydantic import BaseModel

from server_process import ServerProcess
from server_utils import API_KEY

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Tell me about the weather."}]
NO_WS = {"disable_any_whitespace": True}


def _post(server, path, body):
    return requests.post(server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


# ---- the tiny random model ---------------------------------------------------------------------


def test_json_schema_response_format(client):
    for stream in (False, True):
        kw = dict(model="tiny", messages=MSGS, max_tokens=300, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
                  extra_body={"structured_outputs": None})
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                           if ch.choices)
        else:
            out = client.chat.completions.create(**kw)
            assert out.choices[0].finish_reason == "stop"
            text = out.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=300, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["red", "green blue"]}, lambda t: t in ("red", "green blue")),
    ({"structured_outputs": {"choice": ["one", "two"]}}, lambda t: t in ("one", "two")),
    ({"guided_json": PERSON, "guided_whitespace_pattern": None}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}}, lambda t: re.fullmatch("x[0-9][0-9]", t)),
])
def test_structured_fields_on_both_routes(client, extra, check):
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=80, temperature=0, extra_body=extra)
    assert check(chat.choices[0].message.content), chat.choices[0].message.content
    cmpl = client.completions.create(model="tiny", prompt="Answer:", max_tokens=80, temperature=0, extra_body=extra)
    assert check(cmpl.choices[0].text), cmpl.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without --enable-auto-tool-choice
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
])
def test_bad_structured_requests_are_400s(tiny_server, client, body, param):
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_required_and_named_tool_choice(client):
    tools = [WEATHER, TIME]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = client.chat.completions.create(model="tiny", messages=MSGS, tools=tools, tool_choice="required",
                                         max_tokens=150, temperature=0)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    for call in ch.message.tool_calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = dict(model="tiny", messages=MSGS, tools=tools, max_tokens=80, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**named)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])
    # streamed, the deltas reassemble into the same call
    parts: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **named):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            p = parts.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            p["id"] = p["id"] or d.id
            p["name"] += d.function.name or "" if d.function else ""
            p["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls" and list(parts) == [0] and parts[0]["id"]
    assert (parts[0]["name"], parts[0]["arguments"]) == (call.function.name, call.function.arguments)


def test_logit_bias_bans_and_forces(tiny_server, client):
    blue = _post(tiny_server, "/tokenize", {"prompt": " blue", "add_special_tokens": False}).json()["tokens"][0]
    forced = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0, logit_bias={str(blue): 100})
    assert forced.choices[0].text == " blue" * 4
    free = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True)
    first = free.choices[0].logprobs.content[0].token
    first_id = _post(tiny_server, "/tokenize", {"prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    banned = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                            logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first


def test_tokenize_detokenize_info_docs(tiny_server):
    text = "Hello world, how are you?"
    t = _post(tiny_server, "/tokenize", {"model": "tiny", "prompt": text}).json()
    assert t["count"] == len(t["tokens"]) > 3 and t["max_model_len"] == 512
    assert _post(tiny_server, "/detokenize", {"model": "tiny", "tokens": t["tokens"]}).json()["prompt"] == text
    chat = _post(tiny_server, "/tokenize", {"messages": MSGS, "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"]
    assert _post(tiny_server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(tiny_server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    info = requests.get(tiny_server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert info["eos_token"] and info["model_max_length"] == 512
    docs = requests.get(tiny_server.url + "/docs", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_history_with_tool_calls_is_rendered(tiny_server):
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    ids = _post(tiny_server, "/tokenize", {"messages": msgs}).json()["tokens"]
    text = _post(tiny_server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert "get_weather" in text and "Oslo" in text and "sunny, 21 degrees" in text
    r = _post(tiny_server, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_echo_scoring_prompt_logprobs_and_cached_tokens(client):
    prompt = "The quick brown fox jumps over the lazy dog " * 5
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    ch = scored.choices[0]
    n = scored.usage.prompt_tokens
    assert ch.text == prompt and scored.usage.completion_tokens == 0
    assert len(ch.logprobs.token_logprobs) == n and ch.logprobs.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in ch.logprobs.token_logprobs[1:])
    plp = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2})
    lp = plp.choices[0].model_extra["prompt_logprobs"]
    assert len(lp) == n and lp[0] is None and all(len(d) >= 2 for d in lp[1:])
    # the same prompt again (not scored: scoring recomputes every position): the prefix cache
    # served its full blocks
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


# ---- the embedded SmolLM2, greedy, with the hermes parser ----------------------------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import openai

    server = ServerProcess(["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--disable-log-stats",
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                           str(tmp_path_factory.mktemp("logs") / "smol.log"))
    server.wait_ready(timeout=240)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c, c.models.list().data[0].id
    assert server.stop() == 0, server.log_tail()


class Capital(BaseModel):
    country: str
    capital: str


@pytest.mark.slow
def test_smollm2_parse_and_hermes_tool_calls(smol):
    client, model = smol
    out = client.chat.completions.parse(model=model, temperature=0, max_tokens=60, response_format=Capital,
                                        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Capital) and "Paris" in parsed.capital, parsed
    # "auto": the model writes a hermes call (its wording held to the call's shape by a regex)
    call_re = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}", "unit": "c"\}\}\n</tool_call>'
    kw = dict(model=model, temperature=0, max_tokens=60, tools=[WEATHER],
              messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body={"guided_regex": call_re})
    out = client.chat.completions.create(**kw)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    parts: dict[int, dict] = {}
    content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            for d in chunk.choices[0].delta.tool_calls or []:
                p = parts.setdefault(d.index, {"name": "", "arguments": ""})
                p["name"] += d.function.name or ""
                p["arguments"] += d.function.arguments or ""
    assert content == "" and parts == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # without a call in the text, "auto" answers in plain content
    plain = client.chat.completions.create(model=model, temperature=0, max_tokens=12, tools=[WEATHER],
                                           messages=[{"role": "user", "content": "Say hello."}])
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
