"""ToolParser: turns what a model wrote into OpenAI tool calls, for one model family's format.

`extract_tool_calls(text, final)` returns the content before the calls and the calls found so
far; while a stream is still growing (`final=False`) only calls that are complete count.
`start(text)` says where the calls begin (so a stream stops sending content there), and
`held_back(text)` how many trailing characters could be the beginning of that marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def call_from_json(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall | None:
    """{"name": ..., "arguments": {...}} (or "parameters", or arguments as JSON text) -> a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_values(text: str) -> tuple[list[Any], int]:
    """The JSON values at the start of `text` (separated by whitespace, ',' or ';') and where
    parsing stopped."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            return out, i
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out, i
        out.append(value)


class ToolParser:
    name = ""
    marker = ""  # the text that begins the calls
    keep_special_tokens = False  # the marker is a special token: it must stay in the text

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, text: str) -> int:
        """Where the tool calls begin in `text`, or -1."""
        return text.find(self.marker) if self.marker else -1

    def held_back(self, text: str) -> int:
        """The length of the longest suffix of `text` that begins the marker."""
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return k
        return 0

    def extract_tool_calls(self, text: str, final: bool = True) -> ExtractedToolCalls:
        raise NotImplementedError
