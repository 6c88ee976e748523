"""The Executor interface: what the engine may ask of the workers, however many ranks, stages
and machines they are. Invariants every executor keeps:

- `num_gpu_blocks` / `num_cpu_blocks` are the KV blocks every rank holds (the minimum over
  ranks), fixed once the constructor returns;
- steps are collected in the order they were launched; `execute_model(so)` is launch + collect
  and never disturbs steps still in flight;
- with pipeline parallelism, several launched steps are in flight at once and only the output
  rank (distributed/pipeline.py) samples: `collect` returns its tokens;
- once a worker has died or a step has failed, every later call (and `check_health`) raises
  RuntimeError naming the rank; `shutdown` is idempotent and the workers are gone when it
  returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    num_gpu_blocks: int
    num_cpu_blocks: int

    @abstractmethod
    def launch(self, so: SchedulerOutput) -> Any:
        """Queues the step on every rank; returns a handle for `collect`."""

    @abstractmethod
    def collect(self, handle: Any) -> ModelRunnerOutput:
        """Waits for the oldest launched step and returns its sampled tokens."""

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    def check_health(self) -> None:
        """Raises RuntimeError if the executor can run no more steps."""

    def expert_load(self) -> list[int]:
        """MoE: tokens routed to each expert so far ([] for a dense model, or where not read)."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers (idempotent)."""
