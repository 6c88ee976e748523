"""A request body as a JSON object, or the reason it is not one; shared by the OpenAI server and
the router (which must not import the server's pydantic or engine modules)."""

from __future__ import annotations

import json
from typing import Any


class JSONBodyError(ValueError):
    """Not a JSON object; `code` is OpenAI's error code for it (None: a plain 400)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise JSONBodyError("the request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise JSONBodyError(f"the request body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise JSONBodyError("the request body is nested too deeply", "invalid_json") from None
    if not isinstance(data, dict):
        raise JSONBodyError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data
