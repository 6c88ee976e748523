"""Request defaults from the model's generation_config.json, as vLLM's `generation_config="auto"`:
the sampling fields it names (temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as max_tokens) become the defaults of requests that leave them unset: the offline
`generate` without SamplingParams, and every server request field that is absent. "vllm" keeps
the plain defaults; a directory reads its generation_config.json; `override_generation_config`
goes over either. Pure Python."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
}


def generation_defaults(model_config: Any) -> dict[str, Any]:
    """SamplingParams keyword defaults for `model_config` (empty: the plain defaults)."""
    mode = getattr(model_config, "generation_config", "auto")
    out: dict[str, Any] = {}
    folder = None
    if mode == "auto":
        folder = model_config.model if os.path.isdir(model_config.model) else None
    elif mode != "vllm":
        folder = mode
    if folder is not None:
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            out = {dst: data[src] for src, dst in _FIELDS.items() if data.get(src) is not None}
    for key, value in (getattr(model_config, "override_generation_config", None) or {}).items():
        if key not in _FIELDS:
            raise ValueError(f"override_generation_config: {key!r} is not one of {', '.join(sorted(_FIELDS))}")
        out[_FIELDS[key]] = value
    if out:
        logger.info(
            "default sampling parameters (generation_config=%r): %s",
            mode,
            ", ".join(f"{k}={v}" for k, v in sorted(out.items())),
        )
    return out
