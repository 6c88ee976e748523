"""Executor with one worker in the engine's process (tensor_parallel_size=1)."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]):
        self.worker = Worker(config, eos_token_ids)
        num_gpu, num_cpu = self.worker.determine_num_blocks()
        if num_gpu < 1:
            raise ValueError("kv_cache_memory is too small to hold one KV block")
        self.worker.allocate_kv_cache(num_gpu, num_cpu)
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu, num_cpu

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    # asynchronous scheduling: launch step N+1 before collecting step N
    def launch(self, so: SchedulerOutput):
        return self.worker.launch(so)

    def collect(self, handle) -> ModelRunnerOutput:
        return self.worker.collect(handle)

    def expert_load(self) -> list[int]:
        return self.worker.expert_load()

    def shutdown(self) -> None:
        pass
