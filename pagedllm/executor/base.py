"""The Executor interface: what the engine may ask of the workers, however many ranks, stages
and machines they are. Invariants every executor keeps:

- `num_gpu_blocks` / `num_cpu_blocks` are the KV blocks every rank holds (the minimum over
  ranks), fixed once the constructor returns; every executor sizes the cache the same way
  (`init_kv_cache`: each rank measures, all allocate the minimum);
- steps are collected in the order they were launched; `execute_model(so)` is launch + collect
  and never disturbs steps still in flight;
- with pipeline parallelism, several launched steps are in flight at once and only the output
  rank (distributed/pipeline.py) samples: `collect` returns its tokens;
- `collective_rpc(method, args)` calls a Worker method on every rank and returns the results
  by rank;
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

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Calls the Worker's `method(*args)` on every rank; returns the results by rank."""

    def init_kv_cache(self) -> None:
        """Sizes the KV cache (every rank measures what it can hold; all take the minimum) and
        allocates it on every rank."""
        blocks = self.collective_rpc("determine_num_blocks")
        num_gpu = min(b[0] for b in blocks)
        num_cpu = min(b[1] for b in blocks)
        if num_gpu < 1:
            raise ValueError("kv_cache_memory is too small to hold one KV block")
        self.collective_rpc("allocate_kv_cache", (num_gpu, num_cpu))
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu, num_cpu

    def check_health(self) -> None:  # noqa: B027 - an executor with nothing that can die
        """Raises RuntimeError if the executor can run no more steps."""

    def expert_load(self) -> list[int]:
        """MoE: tokens routed to each expert so far ([] for a dense model, or where not read)."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers (idempotent)."""
