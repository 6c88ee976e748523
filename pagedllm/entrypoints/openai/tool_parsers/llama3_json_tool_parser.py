"""Llama 3.1 / 3.2 JSON calls: the answer is one or more JSON objects (after an optional
`<|python_tag|>`), separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    json_values,
)

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = _PYTHON_TAG
    keep_special_tokens = True

    def start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(_PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return -1

    def held_back(self, text: str) -> int:
        return super().held_back(text) if not text.strip() or _PYTHON_TAG.startswith(text.strip()) else 0

    def extract_tool_calls(self, text: str, final: bool = True) -> ExtractedToolCalls:
        begin = self.start(text)
        if begin < 0:
            return ExtractedToolCalls(text)
        body = text[begin:]
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):]
        values, _ = json_values(body)
        calls = [c for c in (call_from_json(v) for v in values) if c is not None]
        if final and (not calls or len(calls) != len(values)):
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(None, calls)
