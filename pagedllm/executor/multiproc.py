"""MultiprocExecutor: tensor and pipeline parallelism on one machine, one process per rank.

Rank 0 runs in the engine's process; ranks 1..N-1 are processes started by fork or spawn
(start_method.py: fork for a script without CUDA, so a script needs no `if __name__ ==
"__main__":` guard; spawn under CUDA). Every rank replays the engine's calls in the same order:

    engine process (rank 0)                        worker process (rank r), one pipe each
    ───────────────────────                        ──────────────────────────────────────
    TCPStore on an OS-picked port ───── port ────▶ joins the gloo (CPU) / NCCL (CUDA) group
    launch(so):  send ("launch", so) ──────────▶   worker.launch(so)
                 worker.launch(so)                 (collectives in the forward keep the ranks
    collect(h):  send ("collect",) ────────────▶    in step; no reply per step)
                 return rank 0's tokens            worker.collect(oldest launched)

All ranks of a stage sample the same tokens (see worker.py). Without pipeline parallelism
rank 0's output is read locally; with it, the output rank (tensor rank 0 of the last stage,
distributed/pipeline.py) is asked for a reply to its "collect", the others are not.

Failure handling, so that nothing hangs and nothing is left behind:
- a thread watches the worker processes; when one dies it records why (and aborts the NCCL
  group, which would otherwise wait); gloo collectives fail at once on a closed socket;
- a worker whose step raises sends its traceback and exits; the engine raises a RuntimeError
  naming the rank, its exit status and that traceback, and the executor stays failed;
- workers exit when the engine's process dies (they watch their parent) and ignore SIGINT
  (Ctrl-C reaches the whole process group; the engine decides);
- shutdown() (also run by a finalizer at garbage collection and at exit) asks the workers to
  stop, then terminates and finally kills any that do not.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import ParallelState, create_store, init_engine_parallel_state
from pagedllm.distributed.pipeline import output_rank, rank_coords
from pagedllm.executor.base import Executor
from pagedllm.executor.child_process import cpu_threads_per_rank, describe_exit, exit_with_parent, send_quietly
from pagedllm.executor.start_method import (
    WorkerStartError,
    refuse_in_spawn_bootstrap,
    start_failure_line,
    worker_start_method,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0  # a worker that is alive but silent this long at startup is stuck
RPC_TIMEOUT_S = 900.0
_STOP_GRACE_S = 5.0


# ---- the worker side ---------------------------------------------------------------------------
class WorkerRPC:
    """What a worker rank answers: the Worker's methods, plus launch/collect keeping the
    launched steps in a queue (a rank collects them in the order the engine does)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.launched: collections.deque = collections.deque()

    def launch(self, so: SchedulerOutput) -> None:
        self.launched.append(self.worker.launch(so))

    def collect(self) -> ModelRunnerOutput:
        return self.worker.collect(self.launched.popleft())

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


def rank_name(rank: int, config: EngineConfig) -> str:
    """How logs and errors name a rank: 'tensor-parallel worker rank 1', or with pipeline
    parallelism 'worker rank 3 (pipeline stage 1, tensor-parallel rank 1)'."""
    pc = config.parallel_config
    if pc.pipeline_parallel_size == 1:
        return f"tensor-parallel worker rank {rank}"
    stage, tp_rank = rank_coords(rank, pc.tensor_parallel_size)
    return f"worker rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


def _worker_main(
    config: EngineConfig, rank: int, store_port: int, conn: multiprocessing.connection.Connection, log_level: int
) -> None:
    """Entry point of rank `rank` >= 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    world_size = config.parallel_config.world_size
    try:
        from pagedllm.worker.worker import Worker

        if config.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        conn.send(("hello", os.getpid()))
        ps = init_engine_parallel_state(config, rank, "127.0.0.1", store_port)
        rpc = WorkerRPC(Worker(config, ps))
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - anything at startup: report it, then go
        send_quietly(conn, ("error", traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # the engine closed its end
        if msg is None:
            break
        method, args, reply = msg
        try:
            result = getattr(rpc, method)(*args)
        except BaseException:  # noqa: BLE001
            tb = traceback.format_exc()
            send_quietly(conn, ("error", tb))
            if not reply:
                # a failed step leaves this rank out of step with the others: stop, so that
                # their collectives fail now instead of waiting for us
                logger.error("step failed on rank %d:\n%s", rank, tb)
                os._exit(1)
            continue
        if reply:
            send_quietly(conn, ("ok", result))
    rpc.worker.release_graphs()
    ps.shutdown()
    conn.close()
    os._exit(0)  # nothing left to run; interpreter teardown would only meet the NCCL group again


# ---- the engine side ---------------------------------------------------------------------------
@dataclass(eq=False)
class _WorkerProc:
    rank: int
    proc: Any  # multiprocessing Process
    conn: multiprocessing.connection.Connection  # the engine's end of the pipe


@dataclass(eq=False)
class _Shared:
    """State the executor, its watcher thread and its finalizer share (the latter two must
    not hold the executor itself, or it would never be collected)."""

    config: Any = None  # the EngineConfig, to name ranks
    workers: list[_WorkerProc] = field(default_factory=list)
    ps: ParallelState | None = None
    driver: Any = None  # rank 0's Worker
    device: str = "cpu"
    error: str | None = None  # set once the executor can no longer run steps
    stopping: bool = False
    wake: tuple | None = None  # (reader, writer) pipe that wakes the watcher at shutdown
    watcher: threading.Thread | None = None
    threads: tuple[int, int] | None = None  # (engine's torch threads before, rank 0's), on CPU


def _death_message(w: _WorkerProc, config: EngineConfig) -> str:
    return (
        f"{rank_name(w.rank, config)} (pid {w.proc.pid}) {describe_exit(w.proc.exitcode)}; "
        "the engine cannot continue and must be restarted"
    )


def _watch(shared: _Shared) -> None:
    """Waits for a worker to die (or for shutdown)."""
    by_sentinel = {w.proc.sentinel: w for w in shared.workers}
    assert shared.wake is not None
    ready = multiprocessing.connection.wait(list(by_sentinel) + [shared.wake[0]])
    if shared.stopping:
        return
    dead = [by_sentinel[s] for s in ready if s in by_sentinel]
    if not dead:
        return
    w = dead[0]
    w.proc.join(1.0)
    if shared.error is None:
        shared.error = _death_message(w, shared.config)
    logger.error("%s", _death_message(w, shared.config))
    if shared.device == "cuda" and shared.ps is not None:
        shared.ps.abort()  # NCCL would wait for the dead rank until its timeout


def _shutdown(shared: _Shared) -> None:
    """Stops every worker process (idempotent; run by shutdown(), GC or interpreter exit)."""
    shared.stopping = True
    if shared.error is None:
        shared.error = "the executor has been shut down"
    for w in shared.workers:
        send_quietly(w.conn, None)
    deadline = time.monotonic() + _STOP_GRACE_S
    for w in shared.workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
    for w in shared.workers:
        if w.proc.is_alive():
            logger.warning("%s did not stop; terminating it", rank_name(w.rank, shared.config))
            w.proc.terminate()
            w.proc.join(2.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(2.0)
        w.conn.close()
    if shared.wake is not None:
        send_quietly(shared.wake[1], None)
        if shared.watcher is not None and shared.watcher is not threading.current_thread():
            shared.watcher.join(2.0)
        shared.wake[0].close()
        shared.wake[1].close()
    if shared.driver is not None:
        shared.driver.release_graphs()
        shared.driver = None
    if shared.ps is not None:
        shared.ps.shutdown()
        shared.ps = None
    if shared.threads is not None and torch.get_num_threads() == shared.threads[1]:
        torch.set_num_threads(shared.threads[0])
    shared.threads = None


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from pagedllm.worker.worker import Worker

        self.config = config
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.output_rank = output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._shared = _Shared(device=config.device, config=config)
        self._finalizer = weakref.finalize(self, _shutdown, self._shared)
        self._store = create_store()
        refuse_in_spawn_bootstrap()
        self.start_method = method = worker_start_method()
        ctx = torch.multiprocessing.get_context(method)
        if method == "fork":
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # its pool does not survive a fork
        level = logging.getLogger("pagedllm").getEffectiveLevel()
        try:
            for rank in range(1, self.world_size):
                engine_end, worker_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(  # type: ignore[attr-defined]
                    target=_worker_main,
                    name=f"pagedllm-rank{rank}",
                    daemon=True,
                    args=(config, rank, self._store.port, worker_end, level),
                )
                proc.start()
                worker_end.close()
                self._shared.workers.append(_WorkerProc(rank, proc, engine_end))
            self._start_watcher()
            for w in self._shared.workers:
                self._recv_started(w, "hello")
            if config.device == "cuda":
                torch.cuda.set_device(0)
            else:
                # ranks share the machine's cores; the engine's process is rank 0 until shutdown
                n = cpu_threads_per_rank(self.world_size)
                self._shared.threads = (torch.get_num_threads(), n)
                torch.set_num_threads(n)
            self._shared.ps = init_engine_parallel_state(config, 0, "127.0.0.1", self._store.port)
            self.driver = self._shared.driver = Worker(config, self._shared.ps)
            for w in self._shared.workers:
                self._recv_started(w, "ok")
            self.init_kv_cache()
        except BaseException:
            self.shutdown()
            raise
        num_gpu = self.num_gpu_blocks
        logger.info(
            "tensor parallelism %d x pipeline parallelism %d: %d ranks (%s), %d KV blocks per rank",
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            self.world_size,
            "NCCL" if config.device == "cuda" else "gloo",
            num_gpu,
        )

    # ---- steps -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self._step("execute_model", (so,), lambda: self.driver.execute_model(so))

    def launch(self, so: SchedulerOutput):
        return self._step("launch", (so,), lambda: self.driver.launch(so), output=False)

    def collect(self, handle) -> ModelRunnerOutput:
        """Collects the oldest launched step (the engine collects in launch order)."""
        return self._step("collect", (), lambda: self.driver.collect(handle))

    def _step(self, method: str, args: tuple, local, output: bool = True):
        """Runs a step on every rank; returns the output rank's result (rank 0's is local; with
        pipeline parallelism only the output rank is asked for a reply) or, without `output`,
        rank 0's."""
        self._check_usable()
        if self.output_rank == 0 or not output:
            self._send_all((method, args, False))
            try:
                return local()
            except BaseException as e:
                self._raise_failed(e)
        out_worker = self._shared.workers[self.output_rank - 1]
        for w in self._shared.workers:
            try:
                w.conn.send((method, args, w is out_worker))
            except OSError as e:  # the worker's end is closed: it died
                self._raise_failed(e)
        try:
            local()  # the first stage samples nothing
            return self._recv(out_worker, RPC_TIMEOUT_S)
        except BaseException as e:
            self._raise_failed(e)

    # ---- control ---------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Calls `method(*args)` on every rank's worker; returns the results by rank."""
        self._check_usable()
        self._send_all((method, args, True))
        try:
            results = [getattr(self.driver, method)(*args)]
        except BaseException as e:
            # the ranks may now disagree (one allocated its cache, another did not): no more steps
            if self._shared.error is None:
                self._shared.error = f"collective_rpc({method!r}) failed on rank 0: {e!r}"
            raise
        results += [self._recv(w, RPC_TIMEOUT_S) for w in self._shared.workers]
        return results

    def expert_load(self) -> list[int]:
        """MoE: rank 0 sees every routing decision, so its counters are the whole load."""
        return self.driver.expert_load()

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._shared.workers]

    def check_health(self) -> None:
        """Raises RuntimeError if a worker has died or a step has failed."""
        self._check_usable()

    def shutdown(self) -> None:
        self._finalizer()

    # ---- internals -------------------------------------------------------------------
    def _recv_started(self, w: _WorkerProc, expect: str) -> Any:
        """A startup message; a worker that fails to start is one WorkerStartError line (its
        traceback goes to the debug log)."""
        try:
            return self._recv(w, STARTUP_TIMEOUT_S, expect=expect)
        except (RuntimeError, TimeoutError) as e:
            logger.debug("tensor-parallel worker rank %d failed to start:\n%s", w.rank, e)
            line = start_failure_line(w.rank, self.start_method, str(e))
            logger.error("%s", line)
            raise WorkerStartError(line) from None

    def _start_watcher(self) -> None:
        self._shared.wake = multiprocessing.Pipe(duplex=False)
        t = threading.Thread(target=_watch, args=(self._shared,), name="pagedllm-tp-watch", daemon=True)
        self._shared.watcher = t
        t.start()

    def _check_usable(self) -> None:
        if self._shared.error is not None:
            raise RuntimeError(self._shared.error)

    def _send_all(self, msg: tuple) -> None:
        data = ForkingPickler.dumps(msg)  # pickled once for all ranks; conn.recv() reads it
        for w in self._shared.workers:
            try:
                w.conn.send_bytes(data)
            except OSError as e:  # the worker's end is closed: it died
                self._raise_failed(e)

    def _raise_failed(self, exc: BaseException):
        err = self._failed(exc)
        if err is exc:
            raise exc
        raise err from exc

    def _recv(self, w: _WorkerProc, timeout: float, expect: str = "ok") -> Any:
        deadline = time.monotonic() + timeout
        while True:
            ready = multiprocessing.connection.wait([w.conn, w.proc.sentinel], max(0.0, deadline - time.monotonic()))
            if w.conn in ready:
                try:
                    kind, value = w.conn.recv()
                except (EOFError, OSError):
                    raise self._failed(None, w) from None
                if kind == "error":
                    self._shared.error = f"{rank_name(w.rank, self.config)} failed:\n{value}"
                    raise RuntimeError(self._shared.error)
                if kind != expect:
                    raise RuntimeError(f"{rank_name(w.rank, self.config)} sent {kind!r}, expected {expect!r}")
                return value
            if w.proc.sentinel in ready:
                raise self._failed(None, w)
            if time.monotonic() >= deadline:
                self._shared.error = f"{rank_name(w.rank, self.config)} did not answer within {timeout:.0f}s"
                raise TimeoutError(self._shared.error)

    def _failed(self, exc: BaseException | None, suspect: _WorkerProc | None = None) -> BaseException:
        """The executor can no longer run steps: find out whether a worker died (its death is
        the cause worth reporting) and return the exception to raise."""
        workers = [suspect] if suspect is not None else self._shared.workers
        dead = next((w for w in workers if not w.proc.is_alive()), None)
        if dead is None and not isinstance(exc, KeyboardInterrupt):
            # a collective fails as soon as a peer's socket closes, a moment before its
            # process is reaped: give the exit status a few seconds to appear
            deadline = time.monotonic() + 5.0
            while dead is None and time.monotonic() < deadline:
                multiprocessing.connection.wait([w.proc.sentinel for w in workers], 0.1)
                dead = next((w for w in workers if not w.proc.is_alive()), None)
        if dead is None:
            if self._shared.error is None:
                self._shared.error = f"a step failed and the ranks are out of step: {exc!r}"
            return exc if exc is not None else RuntimeError(self._shared.error)
        dead.proc.join(1.0)
        msg = _death_message(dead, self.config)
        tb = None
        try:
            while dead.conn.poll():
                kind, value = dead.conn.recv()
                if kind == "error":
                    tb = value
        except (EOFError, OSError):
            pass
        if tb:
            msg += f"; its error:\n{tb}"
        self._shared.error = msg
        return RuntimeError(msg)
