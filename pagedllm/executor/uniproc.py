"""Executor with one worker in the engine's process (one rank: no tensor or pipeline
parallelism)."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)
        self.init_kv_cache()

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    # asynchronous scheduling: launch step N+1 before collecting step N
    def launch(self, so: SchedulerOutput) -> Any:
        return self.worker.launch(so)

    def collect(self, handle: Any) -> ModelRunnerOutput:
        return self.worker.collect(handle)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def expert_load(self) -> list[int]:
        return self.worker.expert_load()

    def shutdown(self) -> None:
        pass
