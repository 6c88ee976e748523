"""SamplingParams: how one request is sampled and when it stops (vLLM's fields and defaults).

Pure Python (no torch). `__post_init__` validates every field and raises `ValueError` naming it.
Limits that depend on the model or the engine (token ids below the vocabulary size, logprobs
up to `max_logprobs`) are checked by the engine's `add_request`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.structured_output.params import StructuredOutputsParams

_MAX_STOP_STRINGS = 64
_MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What the engine reports of a request (vLLM's names): everything so far at each step
    (CUMULATIVE), only what is new since its previous output (DELTA: new token ids, text and
    logprobs; prompt logprobs once), or one output when it has finished (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (a word's last token is banned after its others)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Derived, not set by users: stop_token_ids as a set (by __post_init__), bad_words as token
    # id sequences (by the engine's add_request, which has the tokenizer).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1 or self.n > 128:
            raise ValueError(f"n must be an integer in [1, 128], got {self.n!r}")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.seed == -1:  # vLLM's spelling of "random"
            self.seed = None
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer (or -1: random), got {self.seed!r}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {_MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < -1):
                raise ValueError(f"{name} must be an integer >= 0 (or -1: the whole vocabulary), got {v!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.truncate_prompt_tokens is not None and (
            not is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k) if not isinstance(k, bool) else -1
                except (TypeError, ValueError):
                    tid = -1
                if tid < 0 or (isinstance(k, float)):
                    raise ValueError(f"logit_bias: key {k!r} is not a token id")
                if not is_num(v):
                    raise ValueError(f"logit_bias: the bias of token {k} must be a number, got {v!r}")
                bias[tid] = max(-_MAX_LOGIT_BIAS, min(_MAX_LOGIT_BIAS, float(v)))
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
            or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}") from None
        self.all_stop_token_ids = set(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes: object) -> "SamplingParams":
        from dataclasses import fields

        filled = ("all_stop_token_ids", "bad_words_token_ids")
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in filled}
        kwargs["stop"] = list(self.stop)
        kwargs["stop_token_ids"] = list(self.stop_token_ids)
        kwargs.update(changes)
        out = SamplingParams(**kwargs)
        out.all_stop_token_ids |= self.all_stop_token_ids
        out.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        return out
