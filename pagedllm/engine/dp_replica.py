"""One data-parallel replica (engine/data_parallel.py has the front end): `ReplicaLoop`, its
engine fed with the front end's messages and stepped while it has work, and `replica_main`, the
entry point of a replica process, which drives a ReplicaLoop through one pipe (a Ray actor drives
it from engine/data_parallel_ray.py)."""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import time
import traceback
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import EngineStats
from pagedllm.executor.child_process import cpu_threads_per_rank, exit_with_parent, send_quietly
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)


class ReplicaLoop:
    """One replica's engine, fed with messages and stepped while it has work. `send` carries
    ("out", outputs, stats) back; the transport (a pipe, Ray) is the caller's."""

    def __init__(self, config: EngineConfig, index: int) -> None:
        from pagedllm.engine.llm_engine import LLMEngine

        self.index = index
        self.engine = LLMEngine(config)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "num_gpu_blocks": self.engine.num_gpu_blocks,
            "num_cpu_blocks": self.engine.num_cpu_blocks,
        }

    def apply(self, msg: tuple) -> list[RequestOutput]:
        """Applies one message; returns the outputs of requests it refused."""
        if msg[0] == "add":
            _, rid, prompt, params, age, priority = msg
            try:
                # its age, not its arrival: time.monotonic() is not one clock across hosts
                self.engine.add_request(rid, prompt, params, time.monotonic() - age, priority)
            except ValueError as e:
                return [error_output(rid, str(e))]
        elif msg[0] == "abort":
            self.engine.abort_request(msg[1])
        return []

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        if not engine.has_unfinished_requests():
            return []
        try:
            return engine.step()
        except Exception as e:  # noqa: BLE001 - the step's requests fail; the replica goes on if it can
            logger.exception("replica %d: engine step failed", self.index)
            ids = engine.unfinished_request_ids
            engine.abort_request(ids)
            engine.check_health()  # a dead worker: the replica is done (its front end reports it)
            return [error_output(rid, f"the engine failed while serving this request: {e!r}") for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


def error_output(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        prompt_logprobs=None,
        outputs=[],
        finished=True,
        error=message,
    )


def replica_main(
    config: EngineConfig, index: int, conn: multiprocessing.connection.Connection, log_level: int, num_replicas: int
) -> None:
    """Entry point of a replica process: the engine loop, driven through one pipe."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    if config.device == "cpu":  # the replicas share the machine's cores
        torch.set_num_threads(cpu_threads_per_rank(num_replicas * config.parallel_config.world_size))
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [dp {index}] %(name)s: %(message)s")
    try:
        loop = ReplicaLoop(config, index)
        conn.send(("ready", loop.info()))
    except BaseException:  # noqa: BLE001 - report whatever stopped the start, then go
        send_quietly(conn, ("error", traceback.format_exc()))
        os._exit(1)
    code = 0
    last_stats = None
    try:
        while True:
            busy = loop.engine.has_unfinished_requests()
            outputs: list[RequestOutput] = []
            if conn.poll(0 if busy else 1.0):
                while conn.poll():
                    msg = conn.recv()
                    if msg is None:
                        raise EOFError
                    outputs += loop.apply(msg)
            outputs += loop.step()
            stats = loop.stats()
            if outputs or stats != last_stats:  # an idle replica stays quiet
                conn.send(("out", outputs, stats))
                last_stats = stats
    except (EOFError, OSError):
        pass  # the front end closed its end (or asked us to stop)
    except BaseException:  # noqa: BLE001
        send_quietly(conn, ("error", traceback.format_exc()))
        code = 1
    loop.shutdown()
    os._exit(code)
