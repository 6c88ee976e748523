"""Hermes-style calls (Qwen2.5 / Qwen3, SmolLM, NousResearch Hermes):

    some text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Hermes2ProToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"

    def extract_tool_calls(self, text: str, final: bool = True) -> ExtractedToolCalls:
        begin = self.start(text)
        if begin < 0:
            return ExtractedToolCalls(text)
        bodies = _CALL.findall(text, begin)
        if final:
            last = text.rfind(self.marker)
            if text.find("</tool_call>", last) < 0:  # the last call was not closed (max_tokens, EOS)
                bodies.append(text[last + len(self.marker):])
        calls = []
        for body in bodies:
            try:
                call = call_from_json(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if final and not calls:
            return ExtractedToolCalls(text)  # not a call after all: the text is the answer
        content = text[:begin].strip()
        return ExtractedToolCalls(content or None, calls)
