"""Executors: where the workers run. The engine talks to one through this interface (the
`Executor` base class in base.py) and never knows how many ranks or stages there are:

    num_gpu_blocks, num_cpu_blocks       KV blocks every rank holds (the minimum over ranks)
    execute_model(so) -> ModelRunnerOutput
    launch(so) -> handle; collect(handle) -> ModelRunnerOutput     (asynchronous scheduling;
                                         handles are collected in the order they were launched)
    collective_rpc(method, args) -> [result of rank 0, rank 1, ...]
    expert_load() -> [tokens routed to each expert]   (MoE; [] for a dense model)
    check_health()                       raises RuntimeError once no step can run
    shutdown()                           idempotent; the workers are gone when it returns

`make_executor` picks one from `parallel_config.distributed_executor_backend`:
"uni" (UniProcExecutor: one worker in the engine's process), "mp" (MultiprocExecutor: one
process per rank, rank 0 in the engine's process), "ray" (RayExecutor: one Ray actor per
rank). Ranks are tensor_parallel_size x pipeline_parallel_size. Data parallelism sits above
the executors: each replica is an engine of its own with its own executor
(engine/data_parallel.py).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor
from pagedllm.executor.uniproc import UniProcExecutor


def make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel_config.distributed_executor_backend
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if backend == "mp" and config.parallel_config.world_size > 1:
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    # "uni", or "mp" with a single rank: rank 0 runs in the engine's process either way
    return UniProcExecutor(config)
