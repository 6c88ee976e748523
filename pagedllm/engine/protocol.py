"""EngineClient: what the AsyncLLMEngine (and the server above it) may ask of an engine. The
LLMEngine and the data-parallel front end (DPEngineClient) both are one; so is the test suite's
stand-in (tests/server/fake_engine.py). All of it is called from one thread, the engine loop's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig, ModelConfig
    from pagedllm.engine.step_stats import StepRecord


class EngineClient(Protocol):
    @property
    def config(self) -> EngineConfig:
        """scheduler_config.max_num_seqs bounds what runs at once (per replica)."""

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def tokenizer(self) -> Any:
        """A transformers tokenizer, or None (skip_tokenizer_init)."""

    @property
    def num_steps_scheduled(self) -> int:
        """Steps scheduled so far; the newest are in step_log."""

    @property
    def step_log(self) -> Sequence[StepRecord]: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request (outputs of the kind `params.output_kind` says); ValueError naming
        the field for bad input."""

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops the requests and frees what they hold; unknown ids are ignored."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One engine iteration; the outputs due (at most one per request)."""

    def get_stats(self) -> Any:
        """An EngineStats (DPEngineStats under data parallelism)."""

    def check_health(self) -> None:
        """Raises once no step can ever succeed (a worker or replica died)."""

    def shutdown(self) -> None:
        """Stops the workers; idempotent."""
