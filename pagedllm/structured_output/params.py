"""StructuredOutputsParams: which grammar constrains one request's output (vLLM's fields).

Pure Python (no torch, no grammar engine): it travels inside SamplingParams to the workers.
Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag` is set;
`__post_init__` raises a `ValueError` naming `structured_outputs` otherwise. The compiled
grammar is attached by the engine (`compiled`, never pickled: a worker in another process
compiles its own copy from the spec).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # filled by the engine: the grammar engine's compiled object (never pickled)
    compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            what = "none" if not set_kinds else ", ".join(set_kinds)
            raise ValueError(
                f"structured_outputs: exactly one of {', '.join(_KINDS)} must be set, got {what}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs: json is not a valid JSON schema text: {e}") from None
                if not isinstance(parsed, (dict, bool)):
                    raise ValueError("structured_outputs: json must be a JSON schema object")
            elif not isinstance(self.json, (dict, bool)):
                raise ValueError(f"structured_outputs: json must be a schema object or its JSON text, "
                                 f"got {type(self.json).__name__}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs: choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs: {name} must be a non-empty string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs: json_object must be a boolean")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs: disable_any_whitespace must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The grammar's text, canonical enough to key a cache. A JSON schema keeps its key
        order: properties are generated in the order the schema lists them."""
        kind = self.kind
        v = getattr(self, kind)
        if kind == "json":
            return v if isinstance(v, str) else _json.dumps(v)
        if kind == "choice":
            return _json.dumps(v)
        if kind == "json_object":
            return ""
        return v

    def cache_key(self) -> tuple:
        return (self.kind, self.spec, self.disable_any_whitespace, self.whitespace_pattern)

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in (*_KINDS, "disable_any_whitespace", "whitespace_pattern")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "compiled", None)
