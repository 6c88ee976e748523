"""The tool-call parsers on the formats their models write, whole and as a growing stream:
the streamed deltas reassemble into the same calls and the same content."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import ToolCallStreamer, final_tool_calls
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser

CASES = {
    "hermes": ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>', "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "cet"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": "cet"}}]', None),
}
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "cet"})]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_and_streamed(name):
    text, content = CASES[name]
    parser = get_tool_parser(name)(None)
    got_content, calls = final_tool_calls("auto", "auto", parser, text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED
    assert all(c.id for c in calls) and len({c.id for c in calls}) == 2
    streamer = ToolCallStreamer("auto", "auto", parser)
    streamed, parts = "", {}
    for end in range(1, len(text) + 1):  # one character at a time
        delta, deltas = streamer.update(text[end - 1], end == len(text))
        streamed += delta
        for d in deltas:
            p = parts.setdefault(d.index, ["", ""])
            p[0] += d.function.name or ""
            p[1] += d.function.arguments or ""
    assert streamed.strip() == (content or "")
    assert [(n, json.loads(a)) for n, a in parts.values()] == EXPECTED


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_stays_content(name):
    parser = TOOL_PARSERS[name](None)
    text = "No tools needed: the answer is 42."
    assert final_tool_calls("auto", "auto", parser, text) == (text, [])
    streamer = ToolCallStreamer("auto", "auto", parser)
    out = "".join(streamer.update(text[i - 1], i == len(text))[0] for i in range(1, len(text) + 1))
    assert out == text


def test_broken_call_is_content_and_unknown_parser():
    parser = TOOL_PARSERS["hermes"](None)
    text = "<tool_call>{not json</tool_call>"
    assert final_tool_calls("auto", "auto", parser, text) == (text, [])
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")
