"""What crosses from the scheduler to the workers and back: plain, picklable dataclasses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.outputs import TokenLogprobs
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the workers have not seen, or one resumed after preemption: sent in full."""

    req_id: str
    token_ids: list[int]  # all known tokens (prompt + output so far)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids (min_tokens bans them)


@dataclass(slots=True)
class CachedRequestData:
    """A request that was running last step: only what changed."""

    req_id: str
    new_block_ids: Sequence[int]  # () when none (most steps of a decode): nothing allocated
    num_computed_tokens: int
    # pipeline parallelism only: tokens sampled since the request was last scheduled (the
    # last stage samples them; the other stages learn them here)
    new_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # workers drop their state
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    # of total_num_scheduled_tokens: prompt (or recomputed) tokens, and requests that decode
    # one token; for the engine's step log and metrics
    num_prefill_tokens: int = 0
    num_decodes: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # prompt positions scored this step, for requests that asked for prompt_logprobs
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
