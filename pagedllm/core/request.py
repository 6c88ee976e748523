"""A request as the scheduler sees it: its tokens, how many have KV in the cache, its state."""

from __future__ import annotations

import enum
import time

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # preempted by swap: its KV lives in the CPU pool
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence to generate. `all_token_ids` = prompt + output; the first
    `num_computed_tokens` of them have their K/V in the cache."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "arrival_time",
        "priority",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "max_output_tokens",
        "eos_token_ids",
        "num_preemptions",
        "first_scheduled_time",
        "stop_reason",
        "block_hashes",
        "num_pending",
        "needs_history",
        "stop_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_output_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # all request timing is on time.monotonic()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling, in tokens
        self.max_output_tokens = max_output_tokens
        self.eos_token_ids = eos_token_ids
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chained hashes of its full blocks, filled lazily
        # tokens sampled by steps still in flight (asynchronous scheduling): scheduled, not known
        self.num_pending = 0
        # sampling reads the output's last tokens on the host (bad words of several tokens):
        # no step may run ahead. (Penalties and min_tokens do not: the runner keeps their
        # histories on the device; nor does a grammar: its matcher lives in the runner.)
        sp = sampling_params
        self.needs_history = any(len(w) > 1 for w in sp.bad_words_token_ids)
        # the token ids that can end it (checked on every token, so one set)
        self.stop_ids = frozenset(sp.all_stop_token_ids if sp.ignore_eos else sp.all_stop_token_ids | eos_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions, after a new token was appended."""
        out = self.output_token_ids
        if not out:
            return None
        last = out[-1]
        if last not in self.stop_ids and len(out) < self.max_output_tokens and len(self.all_token_ids) < max_model_len:
            return None  # the common case, decided without the details below
        sp = self.sampling_params
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in sp.all_stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_output_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
