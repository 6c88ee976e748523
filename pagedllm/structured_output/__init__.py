"""Structured outputs: grammars (JSON schema, regex, choice, EBNF/Lark) that hold a request's
output to a shape. `params` is what users set; `manager` compiles and caches (engine side);
`matcher` follows each request and builds the step's packed bitmask (worker side)."""

from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
