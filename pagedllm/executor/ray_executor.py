"""RayExecutor: tensor and pipeline parallelism on a Ray cluster, one actor per rank, for
models larger than one machine (pipeline stages may sit on different nodes). Ray is optional
(`pip install 'pagedllm[ray]'`).

`ray.init()` joins the cluster named by $RAY_ADDRESS (or one started with `ray start`) and
otherwise starts a local one, which Ray stops when the engine's process exits. The ranks are
placed by a placement group (one bundle per rank: a GPU, or on CPU a share of the cores),
packed onto as few nodes as fit. The engine's process holds no rank; it hosts the rendezvous
store (a TCPStore on an OS-picked port) and sends every call to every actor:

    engine process                           actor rank r (r = 0 .. N-1)
    ──────────────                           ───────────────────────────
    launch(so)   ── step("launch", so) ───▶  worker.launch(so)        Ray runs one caller's
    collect(h)   ── step("collect") ──────▶  worker.collect(oldest)   calls to an actor in
                 ◀── rank 0's output ─────                            the order they were sent

Only the output rank returns its output (rank 0; with pipeline parallelism tensor rank 0 of
the last stage, which alone samples). The engine waits on every
rank's reply, taking them as they come, so an actor that dies or raises is reported at once
(RuntimeError naming the rank), not after the other ranks time out.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import create_store, init_engine_parallel_state
from pagedllm.distributed.pipeline import output_rank
from pagedllm.executor.base import Executor
from pagedllm.executor.child_process import cpu_threads_per_rank
from pagedllm.executor.multiproc import WorkerRPC, rank_name

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def init_ray(**kwargs: Any) -> None:
    """`ray.init(**kwargs)` (joins $RAY_ADDRESS's cluster or starts a local one) unless done,
    keeping the caller's SIGTERM handler: ray.init installs one that calls sys.exit(15), which
    would replace the server's (abort a load, drain, exit 0). A default handler is left to Ray."""
    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(**kwargs)
    if callable(before):
        signal.signal(signal.SIGTERM, before)


class RayWorker:
    """One rank, inside a Ray actor (wrapped with `ray.remote` by the executor, so this module
    imports without ray)."""

    def __init__(self, config: EngineConfig, rank: int, num_threads: int, log_level: int) -> None:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
        self.config = config
        self.rank = rank
        pc = config.parallel_config
        self.is_output_rank = rank == output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self.num_threads = num_threads
        self.rpc: WorkerRPC | None = None

    def init_worker(self, store_host: str, store_port: int) -> int:
        import ray
        import torch

        from pagedllm.worker.worker import Worker

        cfg = self.config
        if cfg.device == "cuda":
            torch.cuda.set_device(0)  # Ray shows the actor only its own GPU
        else:
            torch.set_num_threads(self.num_threads)
        ps = init_engine_parallel_state(cfg, self.rank, store_host, store_port, local_ip=ray.util.get_node_ip_address())
        self.rpc = WorkerRPC(Worker(cfg, ps))
        return os.getpid()

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.rpc, method)(*args)

    def step(self, method: str, *args: Any) -> Any:
        # args travel as top-level arguments: Ray resolves an ObjectRef only there
        out = getattr(self.rpc, method)(*args)
        return out if self.is_output_rank else None


def _kill_actors(actors: list, placement_group) -> None:
    try:
        import ray

        if not ray.is_initialized():
            return
        for a in actors:
            ray.kill(a, no_restart=True)
        actors.clear()
        if placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(placement_group)
    except Exception:  # noqa: BLE001 - at interpreter exit Ray may already be gone
        logger.debug("Ray executor shutdown", exc_info=True)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig):
        try:
            import ray
        except ImportError:
            raise ValueError(
                "distributed_executor_backend='ray' needs the ray package: pip install 'pagedllm[ray]'"
            ) from None
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        pc = config.parallel_config
        self.world_size = ws = pc.world_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._error: str | None = None
        init_ray()
        cuda = config.device == "cuda"
        threads = cpu_threads_per_rank(ws)
        bundle = {"GPU": 1} if cuda else {"CPU": threads}
        self._actors: list = []
        self._pg = placement_group([dict(bundle) for _ in range(ws)], strategy="PACK")
        self._finalizer = weakref.finalize(self, _kill_actors, self._actors, self._pg)
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"the Ray cluster cannot place {ws} ranks of {bundle} within {PLACEMENT_TIMEOUT_S:.0f}s "
                    f"(it has {ray.cluster_resources()})"
                )
            actor_cls = ray.remote(num_cpus=0 if cuda else threads, num_gpus=1 if cuda else 0)(RayWorker)
            level = logging.getLogger("pagedllm").getEffectiveLevel()
            for rank in range(ws):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=rank)
                self._actors.append(
                    actor_cls.options(scheduling_strategy=strategy, name=None).remote(config, rank, threads, level)
                )
            self._store = create_store()
            host = ray.util.get_node_ip_address()
            self.worker_pids = self._wait([a.init_worker.remote(host, self._store.port) for a in self._actors])
            self.init_kv_cache()
        except BaseException:
            self.shutdown()
            raise
        num_gpu = self.num_gpu_blocks
        logger.info(
            "tensor parallelism %d x pipeline parallelism %d on Ray: %d ranks (%s), %d KV blocks per rank",
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            ws,
            "NCCL" if cuda else "gloo",
            num_gpu,
        )

    # ---- steps -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self._step("execute_model", (so,))[self.output_rank]

    def launch(self, so: SchedulerOutput):
        self._check_usable()
        import ray

        arg = ray.put(so)
        return [a.step.remote("launch", arg) for a in self._actors]

    def collect(self, handle) -> ModelRunnerOutput:
        """Collects the oldest launched step (the engine collects in launch order)."""
        self._check_usable()
        refs = [a.step.remote("collect") for a in self._actors]
        self._wait(list(handle))
        return self._wait(refs)[self.output_rank]

    def _step(self, method: str, args: tuple) -> list[Any]:
        self._check_usable()
        import ray

        args = tuple(ray.put(a) for a in args)
        return self._wait([a.step.remote(method, *args) for a in self._actors])

    # ---- control ---------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Calls `method(*args)` on every rank's worker; returns the results by rank."""
        self._check_usable()
        return self._wait([a.call.remote(method, args) for a in self._actors])

    def expert_load(self) -> list[int]:
        """Not read: rank 0 is a remote actor, and stats are read every step."""
        return []

    def check_health(self) -> None:
        self._check_usable()

    def shutdown(self) -> None:
        if self._error is None:
            self._error = "the executor has been shut down"
        self._finalizer()

    # ---- internals -------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)

    def _wait(self, refs: list) -> list[Any]:
        """The results of one call per rank, raising as soon as any rank fails."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        self._error = (
                            f"Ray {rank_name(rank_of[ref], self.config)} died; the engine cannot "
                            f"continue and must be restarted ({type(e).__name__}: {e})"
                        )
                        raise RuntimeError(self._error) from e
                    except ray.exceptions.RayTaskError as e:
                        self._error = f"Ray {rank_name(rank_of[ref], self.config)} failed:\n{e}"
                        raise RuntimeError(self._error) from e
        except BaseException as e:
            if self._error is None:
                self._error = f"a step failed and the ranks are out of step: {e!r}"
            raise
        return ray.get(refs)
