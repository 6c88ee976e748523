"""Data-parallel replicas as Ray actors (`--distributed-executor-backend ray`), so replicas may
sit on different nodes of the cluster ($RAY_ADDRESS, or a local one). Imports without ray.

Each actor runs a ReplicaLoop (engine/dp_replica.py) in a thread of its own. The front end
talks to it through one call at a time, `exchange(messages, timeout)`: it hands over the adds
and aborts queued since the last call and returns the outputs the replica produced meanwhile
(waiting up to `timeout` for some). One call at a time keeps the messages in order on an
ordinary (single-threaded) actor; messages queued while a call is out go with the next one.
A replica whose actor dies shows as a RayActorError on its call: reported as dead.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

_EXCHANGE_S = 0.05  # how long one exchange waits for outputs
_START_TIMEOUT_S = 900.0


class RayReplica:
    """The actor's body (wrapped with `ray.remote` by RayReplicas)."""

    def __init__(self, config: EngineConfig, index: int, num_threads: int, log_level: int) -> None:
        import torch

        from pagedllm.engine.dp_replica import ReplicaLoop

        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [dp {index}] %(name)s: %(message)s")
        if config.device == "cpu":
            torch.set_num_threads(num_threads)
        self.loop = ReplicaLoop(config, index)
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._outbox: list[tuple] = []
        self._error: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"pagedllm-dp{index}", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        return self.loop.info()

    def exchange(self, messages: list[tuple], timeout: float) -> list[tuple]:
        with self._cv:
            self._inbox += messages
            self._cv.notify_all()
            if not self._outbox and self._error is None:
                self._cv.wait(timeout)
            if self._error is not None:
                raise RuntimeError(self._error)
            out, self._outbox = self._outbox, []
            return out

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(30)
        self.loop.shutdown()

    def _run(self) -> None:
        import traceback

        last_stats = None
        try:
            while True:
                with self._cv:
                    busy = self.loop.engine.has_unfinished_requests()
                    if not busy and not self._inbox and not self._stopping:
                        self._cv.wait(1.0)
                    if self._stopping:
                        return
                    msgs, self._inbox = self._inbox, []
                outputs = []
                for msg in msgs:
                    outputs += self.loop.apply(msg)
                outputs += self.loop.step()
                stats = self.loop.stats()
                if outputs or stats != last_stats:
                    with self._cv:
                        self._outbox.append(("out", outputs, stats))
                        self._cv.notify_all()
                    last_stats = stats
        except BaseException:  # noqa: BLE001 - the front end learns it on its next exchange
            with self._cv:
                self._error = traceback.format_exc()
                self._cv.notify_all()


class RayReplicas:
    """The front end's side: one actor per replica, one exchange in flight per replica."""

    def __init__(self, config: EngineConfig, n: int) -> None:
        self.config = config
        self.n = n
        self.actors: list[Any] = []
        self._pending: list[list[tuple]] = [[] for _ in range(n)]  # messages for the next exchange
        self._calls: dict[int, Any] = {}  # replica index -> its exchange in flight
        self._deaths: dict[int, str] = {}

    def start(self) -> list[tuple[int, dict]]:
        import ray

        from pagedllm.executor.child_process import cpu_threads_per_rank
        from pagedllm.executor.ray_executor import init_ray

        init_ray()
        cfg = self.config
        cuda = cfg.device == "cuda"
        world = cfg.parallel_config.world_size
        threads = cpu_threads_per_rank(self.n * world)
        # a replica of one rank runs its worker in the actor; a larger one asks Ray for its ranks
        opts: dict[str, Any] = dict(
            num_gpus=1 if cuda and world == 1 else 0, num_cpus=0 if cuda else (threads if world == 1 else 0)
        )
        cls = ray.remote(**opts)(RayReplica)
        level = logging.getLogger("pagedllm").getEffectiveLevel()
        self.actors = [cls.remote(cfg, i, threads, level) for i in range(self.n)]
        refs = [a.info.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_START_TIMEOUT_S)
        if len(ready) < len(refs):
            raise RuntimeError(
                f"the Ray cluster did not start {self.n} data-parallel replicas within "
                f"{_START_TIMEOUT_S:.0f}s (it has {ray.cluster_resources()})"
            )
        infos = []
        for i, ref in enumerate(refs):
            try:
                infos.append((i, ray.get(ref)))
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"data-parallel replica {i} failed to start on Ray:\n{e}") from e
        return infos

    def send(self, i: int, msg: tuple) -> bool:
        if i in self._deaths:
            return False
        self._pending[i].append(msg)
        return True

    def flush(self, replicas: list) -> None:
        """Starts an exchange for every replica that has none in flight (so queued messages
        leave now)."""
        for r in replicas:
            if r.index not in self._calls:
                msgs, self._pending[r.index] = self._pending[r.index], []
                self._calls[r.index] = self.actors[r.index].exchange.remote(msgs, _EXCHANGE_S)

    def receive(self, replicas: list, timeout: float) -> list[tuple[Any, tuple | None]]:
        import ray

        if not replicas:
            return []
        self.flush(replicas)
        by_ref = {self._calls[r.index]: r for r in replicas}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout)
        got: list[tuple[Any, tuple | None]] = []
        for ref in ready:
            r = by_ref[ref]
            del self._calls[r.index]
            try:
                got += [(r, m) for m in ray.get(ref)]
            except ray.exceptions.RayError as e:
                self._deaths[r.index] = f"died on Ray ({type(e).__name__}: {str(e).splitlines()[0]})"
                got.append((r, None))
        return got

    def describe_death(self, i: int) -> str:
        return self._deaths.get(i, "died on Ray")

    def shutdown(self) -> None:
        try:
            import ray

            if not ray.is_initialized():
                return
            stops = []
            for i, a in enumerate(self.actors):
                if i not in self._deaths:
                    stops.append(a.stop.remote())
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=30)
            for a in self.actors:
                ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - at interpreter exit Ray may already be gone
            logger.debug("Ray replicas shutdown", exc_info=True)
        self.actors = []
