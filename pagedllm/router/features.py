"""What the router reads from a request body before choosing: its features (estimated prompt
tokens, max_tokens, turns, code, keywords), the cheap complexity score over them, and the key
that prefix affinity hashes. All of it is string work bounded by `_SCAN_CHARS`; the router has no
tokenizer, so a token is estimated as `CHARS_PER_TOKEN` characters.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from pagedllm.router.config import FeatureConfig, PrefixAffinityConfig

CHARS_PER_TOKEN = 4.0
# Keyword and code scans look at this many characters at most (from the prompt's end, where the
# question usually is): the score must stay cheap for long prompts.
_SCAN_CHARS = 16384
_CODE = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|\bimport \w+|#include\s*<|\bfunction\s+\w+\s*\(|=>|\bSELECT\b.+\bFROM\b"
    r"|\bpublic static\b|;\s*\n\s*\}|\bfn \w+\(",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    prompt_chars: int
    prompt_tokens: int        # estimated (chars / CHARS_PER_TOKEN), or exact for token-id prompts
    max_tokens: int | None
    turns: int                # user messages (1 for a completion)
    has_code: bool
    keyword_hits: int
    text: str                 # the prompt as one string (chat: "role: content" lines)


def prompt_text(body: dict[str, Any]) -> tuple[str, int | None]:
    """The prompt as one string, and the exact token count when the prompt is token ids."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}")
        return "\n".join(parts), None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), None
        if all(isinstance(p, int) for p in prompt):
            return " ".join(map(str, prompt)), len(prompt)
        if all(isinstance(p, list) for p in prompt):
            first = prompt[0]
            return " ".join(map(str, first)), max(len(p) for p in prompt)
    return "", None


def extract_features(body: dict[str, Any], keywords: tuple[str, ...]) -> RequestFeatures:
    text, exact_tokens = prompt_text(body)
    messages = body.get("messages")
    turns = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user") if isinstance(messages, list) else 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    tail = text[-_SCAN_CHARS:]
    lowered = tail.lower()
    return RequestFeatures(
        prompt_chars=len(text),
        prompt_tokens=exact_tokens if exact_tokens is not None else int(len(text) / CHARS_PER_TOKEN + 0.5),
        max_tokens=max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else None,
        turns=max(turns, 1),
        has_code=bool(_CODE.search(tail)),
        keyword_hits=sum(1 for k in keywords if k in lowered),
        text=text,
    )


def complexity_score(f: RequestFeatures, cfg: FeatureConfig) -> float:
    """A weighted sum of features, each scaled to [0, 1]; with the default weights (summing to
    1) the score is in [0, 1]."""
    scaled = {
        "prompt_tokens": min(f.prompt_tokens / cfg.prompt_tokens_scale, 1.0),
        "max_tokens": min((f.max_tokens or 0) / cfg.max_tokens_scale, 1.0),
        "turns": min((f.turns - 1) / cfg.turns_scale, 1.0),
        "code": 1.0 if f.has_code else 0.0,
        "keywords": min(f.keyword_hits / cfg.keywords_scale, 1.0),
    }
    return sum(w * scaled[name] for name, w in cfg.weights.items())


def tier_index_for_score(score: float, thresholds: tuple[float, ...], num_tiers: int) -> int:
    """The first tier whose threshold the score stays under (the last tier past all of them)."""
    for i, t in enumerate(thresholds[: num_tiers - 1]):
        if score < t:
            return i
    return num_tiers - 1


def prefix_key(text: str, cfg: PrefixAffinityConfig) -> int:
    """A 64-bit hash of the prompt's first `num_blocks` whole blocks of `block_chars` characters
    (the whole prompt when it is shorter than one block): requests that share those blocks map
    to one replica, whose prefix cache then holds them."""
    whole = min(len(text) // cfg.block_chars, cfg.num_blocks) * cfg.block_chars
    head = text[:whole] if whole else text
    return int.from_bytes(hashlib.blake2b(head.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
