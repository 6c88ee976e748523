"""What a request's structured-output and tool fields mean for the engine: OpenAI's
`response_format`, vLLM's `structured_outputs` and older `guided_*` fields become one
StructuredOutputsParams; `tools` with `tool_choice` "required" or a named function become a JSON
schema the output must follow (so the arguments always parse and match), and that output
becomes tool calls again. Every mistake is an APIError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall
from pagedllm.structured_output.params import StructuredOutputsParams

_SO_FIELDS = frozenset(f.name for f in fields(StructuredOutputsParams) if f.name != "compiled")
_BACKENDS = (None, "auto", "xgrammar")


def _so(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise APIError(str(e).replace("structured_outputs", param, 1), param=param) from None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _so("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError("response_format.json_schema must be an object with a `schema`", param="response_format")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise APIError("response_format.json_schema.schema is missing", param="response_format")
        return _so("response_format", json=schema)
    raise APIError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   param="response_format")


def request_structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The one grammar a completion or chat request asks for, or None."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.response_format:
        so = _from_response_format(req.response_format)
        if so is not None:
            found.append(("response_format", so))
    if req.structured_outputs:
        unknown = sorted(set(req.structured_outputs) - _SO_FIELDS)
        if unknown:
            raise APIError(f"structured_outputs: unknown field {unknown[0]!r} (known: {', '.join(sorted(_SO_FIELDS))})",
                           param="structured_outputs")
        found.append(("structured_outputs", _so("structured_outputs", **req.structured_outputs)))
    guided = {k: getattr(req, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
    for k, v in guided.items():
        if v is not None:
            found.append((f"guided_{k}", _so(f"guided_{k}", **{k: v},
                                             whitespace_pattern=req.guided_whitespace_pattern)))
    if req.guided_decoding_backend not in _BACKENDS:
        raise APIError(f"guided_decoding_backend: only xgrammar is available, got {req.guided_decoding_backend!r}",
                       param="guided_decoding_backend")
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(f"only one structured output may be asked for, got {names}", param=found[1][0])
    return found[0][1] if found else None


# ---- tools --------------------------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each function tool."""
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        out[name] = params
    return out


def normalize_tool_choice(choice: Any, tools: dict[str, dict[str, Any]]) -> str:
    """"none" | "auto" | "required" | "function:NAME"."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                           param="tool_choice")
        if choice != "none" and not tools:
            raise APIError(f"tool_choice={choice!r} needs tools", param="tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError('tool_choice must name a function: {"type": "function", "function": {"name": ...}}',
                       param="tool_choice")
    if name not in tools:
        raise APIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "function:" + name


def forced_tool_schema(choice: str, tools: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema that "required" (a list of {name, parameters}) or a named function (its
    arguments) must follow."""
    if choice.startswith("function:"):
        return tools[choice[len("function:"):]]
    items = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, "parameters": p},
         "required": ["name", "parameters"], "additionalProperties": False}
        for n, p in tools.items()
    ]}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_tool_calls(choice: str, text: str) -> list[ParsedToolCall]:
    """The calls in an output made under forced_tool_schema (a grammar guarantees its shape;
    an output cut by max_tokens gives none)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list if choice == "required" else dict):
        return []
    if choice.startswith("function:"):  # the text is the arguments, as streamed
        return [ParsedToolCall(choice[len("function:"):], text)]
    return [ParsedToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
            for c in value if isinstance(c, dict) and isinstance(c.get("name"), str)]
