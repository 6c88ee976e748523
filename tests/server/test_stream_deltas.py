"""Streams built from the engine's DELTA outputs, read as raw SSE from the real server (the tiny
random Llama, greedy): for a matrix of requests (completions and chat; n=2, several prompts,
logprobs, stop strings, echo, usage with and without continuous stats, named and required tool
calls) the reassembled stream equals the non-streamed response of the same request, and the
chunks have OpenAI's structure: in chat one role chunk first per choice, the finish reason
only on a choice's last chunk, the usage chunk last, then [DONE]."""

from __future__ import annotations

import json

import pytest
import requests

from server_utils import API_KEY

GREEDY = {"temperature": 0.0, "ignore_eos": True}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
MSGS = [{"role": "user", "content": "Tell me a story about the sea."}]


def _post(server, path: str, body: dict) -> requests.Response:
    r = requests.post(server.url + path, json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _events(server, path: str, body: dict) -> list[dict]:
    """The SSE events of a streamed request, [DONE] checked and dropped."""
    r = _post(server, path, {**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    raw = r.content.decode()
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-2]), frames
    return [json.loads(f[len("data: "):]) for f in frames[:-2]]


def _stop_string(text: str) -> str:
    """Three characters from the middle of `text` (so a stop string can span tokens)."""
    for i in range(len(text) // 3, len(text) - 3):
        s = text[i : i + 3]
        if s.strip() and "\ufffd" not in s:
            return s
    pytest.skip("no usable stop string in the output")


def _check_usage(events: list[dict], full: dict, body: dict) -> None:
    opts = body.get("stream_options") or {}
    usage_keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if opts.get("include_usage"):
        last = events[-1]
        assert last["choices"] == [] and {k: last["usage"][k] for k in usage_keys} == \
            {k: full["usage"][k] for k in usage_keys}
        events = events[:-1]
    assert all(e["choices"] for e in events)  # no other chunk without a choice
    if opts.get("continuous_usage_stats"):
        counts = [e["usage"]["completion_tokens"] for e in events if e.get("usage")]
        assert counts and counts == sorted(counts) and counts[-1] == full["usage"]["completion_tokens"]
    else:
        assert all(e.get("usage") is None for e in events)


def _per_choice(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        if e["choices"]:
            assert len(e["choices"]) == 1
            out.setdefault(e["choices"][0]["index"], []).append(e["choices"][0])
    return out


def _check_finish(mine: list[dict], ref: dict) -> None:
    assert mine[-1]["finish_reason"] == ref["finish_reason"]
    assert mine[-1].get("stop_reason") == ref.get("stop_reason")
    assert all(c["finish_reason"] is None for c in mine[:-1])


COMPLETIONS = {
    "plain": dict(prompt="Once upon a time", max_tokens=24),
    "n2 usage": dict(prompt="Pick a number:", max_tokens=12, n=2, stream_options={"include_usage": True}),
    "prompts continuous": dict(prompt=["first prompt", "second one"], max_tokens=10, n=2,
                               stream_options={"include_usage": True, "continuous_usage_stats": True}),
    "logprobs": dict(prompt="The weather today", max_tokens=10, logprobs=2),
    "echo logprobs": dict(prompt="Echo me please", max_tokens=6, echo=True, logprobs=1),
    "stop": dict(prompt="Once upon a time", max_tokens=24, stop="<from output>"),
    "stop included n2": dict(prompt="Once upon a time", max_tokens=24, n=2, stop="<from output>",
                             include_stop_str_in_output=True, stream_options={"include_usage": True}),
}


@pytest.mark.parametrize("case", sorted(COMPLETIONS))
def test_completion_stream_equals_response(tiny_server, case):
    body = {"model": "tiny", **GREEDY, **COMPLETIONS[case]}
    if body.get("stop") == "<from output>":
        plain = _post(tiny_server, "/v1/completions", {**body, "stop": None}).json()
        body["stop"] = [_stop_string(plain["choices"][0]["text"]), "\n\n\n\n"]
    full = _post(tiny_server, "/v1/completions", body).json()
    if "stop" in case:
        assert full["choices"][0]["finish_reason"] == "stop"
    events = _events(tiny_server, "/v1/completions", body)
    _check_usage(events, full, body)
    got = _per_choice(events)
    assert sorted(got) == [c["index"] for c in full["choices"]]
    for ref in full["choices"]:
        mine = got[ref["index"]]
        assert "".join(c["text"] for c in mine) == ref["text"]
        _check_finish(mine, ref)
        if body.get("logprobs") is not None:
            lps = [c["logprobs"] for c in mine if c["logprobs"]]
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                assert [x for lp in lps for x in lp[key]] == ref["logprobs"][key], key
        else:
            assert all(c["logprobs"] is None for c in mine)


CHATS = {
    "plain": dict(max_tokens=24),
    "n2 continuous": dict(max_tokens=12, n=2, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    "logprobs n2": dict(max_tokens=10, n=2, logprobs=True, top_logprobs=2, stream_options={"include_usage": True}),
    "stop": dict(max_tokens=24, stop="<from output>", stream_options={"include_usage": True}),
    "named tool": dict(max_tokens=60, tools=TOOLS,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "required tool": dict(max_tokens=120, tools=TOOLS, tool_choice="required", stream_options={"include_usage": True}),
}


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_stream_equals_response(tiny_server, case):
    body = {"model": "tiny", "messages": MSGS, **GREEDY, **CHATS[case]}
    if "tools" in body:
        body.pop("ignore_eos")  # the grammar ends the call
    if body.get("stop") == "<from output>":
        plain = _post(tiny_server, "/v1/chat/completions", {**body, "stop": None}).json()
        body["stop"] = [_stop_string(plain["choices"][0]["message"]["content"])]
    full = _post(tiny_server, "/v1/chat/completions", body).json()
    if "stop" in case:
        assert full["choices"][0]["finish_reason"] == "stop"
    events = _events(tiny_server, "/v1/chat/completions", body)
    _check_usage(events, full, body)
    n = body.get("n", 1)
    # the role chunks come first, one per choice, and nowhere else
    assert [e["choices"][0] for e in events[:n]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
         "stop_reason": None} for i in range(n)]
    assert all("role" not in e["choices"][0]["delta"] for e in events[n:] if e["choices"])
    got = _per_choice(events[n:])
    assert sorted(got) == [c["index"] for c in full["choices"]]
    for ref in full["choices"]:
        mine = got[ref["index"]]
        _check_finish(mine, ref)
        msg = ref["message"]
        content = "".join(c["delta"].get("content") or "" for c in mine)
        assert content == (msg["content"] or "")
        calls: dict[int, list[str]] = {}
        for c in mine:
            for d in c["delta"].get("tool_calls") or []:
                fn = d.get("function") or {}
                p = calls.setdefault(d["index"], ["", ""])
                p[0] += fn.get("name") or ""
                p[1] += fn.get("arguments") or ""
        assert [tuple(p) for _, p in sorted(calls.items())] == \
            [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or []]
        if "tool" in case:
            assert ref["finish_reason"] == "tool_calls" and calls
        if body.get("logprobs"):
            entries = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
            assert entries == ref["logprobs"]["content"]


def test_text_chunk_frames_are_pydantics_bytes():
    # the plain chunk's frame cut from a template equals the model dumped by pydantic, for
    # texts with quotes, backslashes, control and non-ASCII characters
    import random

    from pagedllm.entrypoints.openai.protocol import (
        ChatCompletionStreamChoice,
        ChatCompletionStreamResponse,
        CompletionResponseChoice,
        CompletionStreamResponse,
        DeltaMessage,
    )
    from pagedllm.entrypoints.openai.streaming import TextChunks, sse

    def chat(i, text):
        return ChatCompletionStreamResponse(id="chatcmpl-1f", created=1764700000, model='ti"ny',
                                            choices=[ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text))])

    def cmpl(i, text):
        return CompletionStreamResponse(id="cmpl-2e", created=1764700000, model="tiny",
                                        choices=[CompletionResponseChoice(index=i, text=text)])

    rng = random.Random(0)
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "\u2028", "é", "中", "🤖", "\ufffd", "/", "<", "a", " "]
    for make in (chat, cmpl):
        chunks = TextChunks(make)
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
            i = rng.randrange(0, 40)
            assert chunks.frame(i, text) == sse(make(i, text))
    # placeholders that are not found exactly once: no template (the models are used)
    assert TextChunks(lambda i, text: CompletionStreamResponse(
        id="cmpl-918273645", created=1, model="m", choices=[CompletionResponseChoice(index=i, text=text)])).frame(0, "x") is None
