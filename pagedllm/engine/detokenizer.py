"""Incremental detokenization and stop strings.

With a fast (Rust `tokenizers`) tokenizer, text comes from its `DecodeStream`, which holds
back incomplete UTF-8 sequences itself (about 2 us a token). Otherwise a short window of token
ids is decoded twice, with and without the newest tokens, and the difference emitted; while the
window ends in an incomplete UTF-8 sequence (decodes to U+FFFD) nothing is emitted yet. Either
way the concatenated deltas equal `tokenizer.decode(all output ids)`.

Stop strings are searched only in the tail that new text can affect, so a stop string split
across tokens is found; the text is cut before it (or after it with
include_stop_str_in_output). Until a request finishes, the last max_stop_len - 1 characters
are held back from `visible_text`, so a stream never shows the start of a stop string.

`spaces_between_special_tokens=False` (with `skip_special_tokens=False`): a special (added)
token that follows another is emitted as its bare content, without the space the tokenizer's
decoder may put before it (as vLLM does; True, the default, keeps the decoder's text).

A request reported only when finished, without stop strings, whose text can come from one
decode (`can_defer`: spaces_between_special_tokens or skip_special_tokens set), needs no
detokenizer: the engine decodes its ids once, at the end (`decode_final`).
"""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams


def can_defer(params: SamplingParams) -> bool:
    """Whether one decode of all the ids gives the text the incremental path would."""
    return params.skip_special_tokens or params.spaces_between_special_tokens


def decode_final(tokenizer: Any, params: SamplingParams, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = params.max_stop_len
        self.token_ids: list[int] = []  # only without a DecodeStream (it keeps its own window)
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        # id -> content of the added tokens, only where spaces between them are to be dropped
        self._added: dict[int, str] | None = None
        self._last_added = False
        if not can_defer(params):
            self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if backend is not None:
            try:
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
                self._backend = backend
            except (ImportError, TypeError):
                self._stream = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int, detokenize: bool = True) -> str | None:
        """Adds one token; returns the stop string matched, if any."""
        if self._stream is None:
            self.token_ids.append(token_id)
        if not detokenize:
            return None
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if self._added is not None:
                delta = self._bare_added(token_id, delta)
            if not delta:
                return None
            self._append(delta)
            return self._check_stop(len(delta)) if self.stop else None
        ids = self.token_ids
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # wait for the rest of a multi-byte character
        delta = self._bare_added(token_id, new_text[len(prefix_text) :]) or ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self._append(delta)
        return self._check_stop(len(delta))

    def _append(self, delta: str) -> None:
        # `self.text += delta` would copy the whole text on every token; a local that holds the
        # only reference is grown in place by CPython (amortized O(len(delta)))
        text, self.text = self.text, ""
        text += delta
        self.text = text

    def _bare_added(self, token_id: int, delta: str | None) -> str | None:
        if self._added is None:
            return delta
        content = self._added.get(token_id)
        if content is not None and self._last_added:
            delta = content
        self._last_added = content is not None
        return delta

    def _check_stop(self, delta_len: int) -> str | None:
        if not self.stop:
            return None
        start = max(0, len(self.text) - delta_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_len(self, finished: bool) -> int:
        """How much of `text` may be shown: all once finished, else all but what could still
        turn out to begin a stop string."""
        if finished or self.max_stop_len <= 1 or self.include_stop:
            return len(self.text)
        return max(0, len(self.text) - (self.max_stop_len - 1))

    def visible_text(self, finished: bool) -> str:
        return self.text[: self.visible_len(finished)]
