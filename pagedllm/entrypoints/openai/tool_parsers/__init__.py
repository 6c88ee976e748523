"""Tool-call parsers, by the name `--tool-call-parser` takes."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Hermes2ProToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}") from None


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedToolCall", "ToolParser", "get_tool_parser"]
