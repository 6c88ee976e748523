"""Mistral calls: `[TOOL_CALLS]` (a special token) and then a JSON list of calls:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    json_values,
)


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keep_special_tokens = True

    def extract_tool_calls(self, text: str, final: bool = True) -> ExtractedToolCalls:
        begin = self.start(text)
        if begin < 0:
            return ExtractedToolCalls(text)
        values, _ = json_values(text[begin + len(self.marker):])
        items = [x for v in values for x in (v if isinstance(v, list) else [v])]
        calls = [c for c in (call_from_json(v) for v in items) if c is not None]
        if final and not calls:
            return ExtractedToolCalls(text)
        content = text[:begin].strip()
        return ExtractedToolCalls(content or None, calls)
