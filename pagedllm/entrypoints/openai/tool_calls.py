"""Tool calls in chat responses: from a finished output (`final_tool_calls`) and from a growing
stream (`ToolCallStreamer`), the way OpenAI sends them.

Modes: "named" (tool_choice names a function: the output is its arguments, streamed as they
grow after a first delta with the id and name), "required" (the output is a JSON list of
{name, parameters}: the calls are sent once it is complete), "auto" (a tool parser finds calls
in the text: content streams until the parser's marker, each call is sent once it is closed).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from pagedllm.entrypoints.openai.structured_outputs import forced_tool_calls
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser


def tool_mode(choice: str, parser: ToolParser | None) -> str | None:
    if choice.startswith("function:"):
        return "named"
    if choice == "required":
        return "required"
    if choice == "auto" and parser is not None:
        return "auto"
    return None


def final_tool_calls(mode: str, choice: str, parser: ToolParser | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output."""
    if mode == "auto":
        ext = parser.extract_tool_calls(text, final=True)
        content, calls = ext.content, ext.tool_calls
    else:
        content, calls = None, forced_tool_calls(choice, text)
        if not calls:  # cut short (max_tokens): the text is all there is
            content = text
    return content, [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


class ToolCallStreamer:
    """One choice's stream: `update(new text, done)` -> (content delta, tool-call deltas). Only
    the modes that parse the whole output ("required", "auto") keep it."""

    def __init__(self, mode: str, choice: str, parser: ToolParser | None) -> None:
        self.mode, self.choice, self.parser = mode, choice, parser
        self.text = ""  # required / auto: the output so far
        self.sent_content = 0
        self.num_calls = 0

    def _deltas(self, calls: list[ParsedToolCall]) -> list[DeltaToolCall]:
        out = []
        for c in calls:
            out.append(DeltaToolCall(index=self.num_calls, id=random_id("chatcmpl-tool"), type="function",
                                     function=DeltaFunctionCall(name=c.name, arguments=c.arguments)))
            self.num_calls += 1
        return out

    def update(self, new: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        if self.mode == "named":  # the output is the arguments: passed on as they come
            deltas = []
            if self.num_calls == 0:
                deltas = self._deltas([ParsedToolCall(self.choice[len("function:"):], "")])
            if new:
                deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new)))
            return "", deltas
        self.text += new
        if self.mode == "required":
            return ("", self._deltas(forced_tool_calls(self.choice, self.text))) if done else ("", [])
        return self._auto(self.text, done)

    def _auto(self, text: str, done: bool) -> tuple[str, list[Any]]:
        p = self.parser
        begin = p.start(text)
        if begin < 0:
            end = len(text) if done else len(text) - p.held_back(text)
            content = text[self.sent_content:end] if end > self.sent_content else ""
            self.sent_content = max(self.sent_content, end)
            return content, []
        content = text[self.sent_content:begin] if begin > self.sent_content else ""
        self.sent_content = max(self.sent_content, begin)
        ext = p.extract_tool_calls(text, final=done)
        if done and not ext.tool_calls:  # no call after all: the rest is content
            content += text[self.sent_content:]
            self.sent_content = len(text)
            return content, []
        return content, self._deltas(ext.tool_calls[self.num_calls:])
