"""Data parallelism: N engine replicas behind one front end (`DPEngineClient`), which the
offline `LLM` and the server's `AsyncLLMEngine` drive exactly like one `LLMEngine`.

Each replica is a whole LLMEngine (scheduler, KV cache, its own tensor x pipeline ranks) in a
process of its own (mp) or a Ray actor (ray, replicas may sit on different nodes). The front
end checks each request (the ValueErrors of add_request, so bad input is still refused at
once), picks a replica, and gathers the replicas' outputs in `step()`:

    DPEngineClient (the caller's thread)                   replica i (process or actor)
    ───────────────────────────────────                    ────────────────────────────
    add_request: check, pick replica ── ("add", ...) ──▶   engine.add_request
    abort_request ───────────────────── ("abort", ids) ─▶  engine.abort_request
    step(): outputs of every replica ◀─ ("out", outputs, stats) ── engine.step(), stats

Load balancing: the replica with the fewest unfinished requests of its own (waiting + running,
counted here, so requests sent since its last report count too), then the lowest KV-cache
usage. With `data_parallel_prefix_affinity`, a prompt goes to the replica its first
AFFINITY_BLOCKS blocks of tokens hash to (so shared prefixes hit one replica's prefix cache),
unless that replica is busier than the least busy one by more than a quarter of max_num_seqs.

A replica that dies is reported (log, its requests fail with an error, `get_stats().replicas`
and the `pagedllm:dp_replica_up` metric) and the others keep serving; only when none is left
does `check_health()` raise. Replicas exit with the front end's process.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing.connection
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.dp_replica import error_output, replica_main
from pagedllm.engine.llm_engine import EngineStats, LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

AFFINITY_BLOCKS = 4
STARTUP_TIMEOUT_S = 900.0
_POLL_S = 0.01  # how long step() waits for a replica's outputs before it returns none


def replica_config(config: EngineConfig) -> EngineConfig:
    """The config of one replica: data_parallel_size 1; its own ranks run with mp (or ray)."""
    pc = config.parallel_config
    backend = pc.distributed_executor_backend if pc.world_size > 1 else "uni"
    return dataclasses.replace(
        config, parallel_config=dataclasses.replace(pc, data_parallel_size=1, distributed_executor_backend=backend)
    )


@dataclass(slots=True)
class DPEngineStats(EngineStats):
    """The replicas' stats summed (KV usage: over all their blocks), and each replica's own
    (None once it has died)."""

    replicas: list[EngineStats | None] = field(default_factory=list)


# ---- the front end -----------------------------------------------------------------------------
@dataclass(eq=False)
class _Replica:
    index: int
    handle: Any  # the replica's transport (see ProcessReplicas / RayReplicas)
    pid: int = 0
    alive: bool = True
    requests: set[str] = field(default_factory=set)  # unfinished requests it serves
    stats: EngineStats | None = None


class DPEngineClient:
    """The LLMEngine interface over `data_parallel_size` replicas."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.model.loader import eos_token_ids, load_tokenizer

        t0 = time.time()
        self.config = config
        mc = self.model_config = config.model_config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(mc.model, mc.tokenizer, mc.gguf_file)
        self.eos_token_ids = eos_token_ids(mc.model, mc.gguf_file, mc.hf_config, self.tokenizer)
        from pagedllm.engine.generation_defaults import generation_defaults

        self.default_sampling_params: dict = generation_defaults(mc)
        self._structured = None  # the grammar compiler, made on first use (structured_output_manager)
        pc = config.parallel_config
        self.prefix_affinity = pc.data_parallel_prefix_affinity
        self.affinity_tokens = AFFINITY_BLOCKS * config.cache_config.block_size
        self._owner: dict[str, _Replica] = {}
        if pc.distributed_executor_backend == "ray":
            from pagedllm.engine.data_parallel_ray import RayReplicas

            self.transport: Any = RayReplicas(replica_config(config), pc.data_parallel_size)
        else:
            self.transport = ProcessReplicas(replica_config(config), pc.data_parallel_size)
        self._finalizer = weakref.finalize(self, self.transport.shutdown)
        try:
            infos = self.transport.start()
        except BaseException:
            self.shutdown()
            raise
        self.replicas = [_Replica(i, h, info["pid"]) for i, (h, info) in enumerate(infos)]
        self.num_gpu_blocks = sum(info["num_gpu_blocks"] for _, info in infos)
        self.num_cpu_blocks = sum(info["num_cpu_blocks"] for _, info in infos)
        # the per-step records stay in the replicas (the engine page shows none under DP)
        self.num_steps_scheduled = 0
        self.step_log: collections.deque = collections.deque()
        logger.info(
            "data parallelism: %d replicas (%s) ready in %.1fs",
            len(self.replicas),
            pc.distributed_executor_backend,
            time.time() - t0,
        )

    # ---- requests in -----------------------------------------------------------------
    # LLMEngine's own request checks, run here before a replica is picked (so bad input is a
    # ValueError at once, as with one engine); they read only tokenizer, model_config,
    # eos_token_ids and _structured
    tokenize_prompt = LLMEngine.tokenize_prompt
    check_request = LLMEngine.check_request
    check_sampling_params = LLMEngine.check_sampling_params
    structured_output_manager = LLMEngine.structured_output_manager
    apply_chat_template = LLMEngine.apply_chat_template
    get_default_sampling_params = LLMEngine.get_default_sampling_params

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Checks the request as LLMEngine.add_request does (ValueError naming the field) and
        queues it on a replica. RuntimeError when no replica is left."""
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params, text, ids = self.check_request(prompt, params, priority)  # type: ignore[misc]
        replica = self._pick(ids)
        age = 0.0 if arrival_time is None else max(0.0, time.monotonic() - arrival_time)
        sent = {"prompt_token_ids": ids} if text is None else {"prompt": text, "prompt_token_ids": ids}
        if not self.transport.send(replica.handle, ("add", request_id, sent, params, age, priority)):
            self._died(replica)
            return self.add_request(request_id, prompt, params, arrival_time, priority)
        replica.requests.add(request_id)
        self._owner[request_id] = replica

    def _pick(self, ids: list[int]) -> _Replica:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise RuntimeError("every data-parallel replica has died; the engine must be restarted")

        def load(r: _Replica) -> tuple[int, float, int]:
            return len(r.requests), r.stats.kv_cache_usage if r.stats is not None else 0.0, r.index

        best = min(live, key=load)
        if self.prefix_affinity:
            home = live[hash(tuple(ids[: self.affinity_tokens])) % len(live)]
            slack = max(1, self.config.scheduler_config.max_num_seqs // 4)
            if len(home.requests) <= len(best.requests) + slack:
                return home
        return best

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            replica = self._owner.pop(rid, None)
            if replica is not None:
                replica.requests.discard(rid)
                by_replica.setdefault(replica.index, []).append(rid)
        for index, rids in by_replica.items():
            replica = self.replicas[index]
            if replica.alive and not self.transport.send(replica.handle, ("abort", rids)):
                self._died(replica)
        self.transport.flush([r for r in self.replicas if r.alive])

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    # ---- outputs ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """The outputs the replicas have sent since the last call (waits a moment for some
        when requests are in flight)."""
        outputs: list[RequestOutput] = []
        live = [r for r in self.replicas if r.alive]
        for replica, msg in self.transport.receive(live, _POLL_S if self._owner else 0.0):
            if msg is None:
                outputs += self._died(replica)
                continue
            _, outs, stats = msg
            replica.stats = stats
            for out in outs:
                if self._owner.get(out.request_id) is not replica:
                    continue  # aborted here since the replica sent it
                if out.finished:
                    del self._owner[out.request_id]
                    replica.requests.discard(out.request_id)  # type: ignore[union-attr]
                outputs.append(out)
        return outputs

    def _died(self, replica: _Replica) -> list[RequestOutput]:
        """Marks a replica dead; returns error outputs for the requests it was serving."""
        if not replica.alive:
            return []
        replica.alive = False
        replica.stats = None
        why = self.transport.describe_death(replica.handle)
        lost = sorted(replica.requests)
        msg = f"data-parallel replica {replica.index} (pid {replica.pid}) {why}; {len(lost)} of its requests failed"
        left = sum(r.alive for r in self.replicas)
        logger.error("%s; %d replica(s) keep serving", msg, left)
        for rid in lost:
            self._owner.pop(rid, None)
        replica.requests.clear()
        return [error_output(rid, msg) for rid in lost]

    # ---- introspection ---------------------------------------------------------------
    def get_stats(self) -> DPEngineStats:
        per = [r.stats if r.alive else None for r in self.replicas]
        have = [s for s in per if s is not None]
        numbers = [f.name for f in dataclasses.fields(EngineStats) if f.type in ("int", "float")]
        zeros: dict[str, Any] = {name: 0 for name in numbers}
        total = DPEngineStats(**zeros, replicas=per)
        for s in have:
            for name in numbers:
                setattr(total, name, getattr(total, name) + getattr(s, name))
            for name in ("expert_load", "expert_load_per_rank"):  # MoE: summed per expert
                mine, theirs = getattr(total, name), getattr(s, name, [])
                setattr(total, name, [a + b for a, b in zip(mine, theirs)] if mine else list(theirs))
        if total.num_gpu_blocks:
            total.kv_cache_usage = 1.0 - total.num_free_blocks / total.num_gpu_blocks
        total.num_waiting += sum(len(r.requests) for r in self.replicas if r.alive and r.stats is None)
        return total

    def check_health(self) -> None:
        if not any(r.alive for r in self.replicas):
            raise RuntimeError("every data-parallel replica has died; the engine must be restarted")

    def shutdown(self) -> None:
        """Stops every replica (idempotent)."""
        self._finalizer()


class ProcessReplicas:
    """Replicas as processes on this machine, one duplex pipe each. A replica's own ranks are
    its children, so replicas are not daemonic; they exit when this process does."""

    def __init__(self, config: EngineConfig, n: int) -> None:
        self.config = config
        self.n = n
        self.procs: list[Any] = []
        self.conns: list[multiprocessing.connection.Connection] = []

    def start(self) -> list[tuple[int, dict]]:
        import torch

        ctx = torch.multiprocessing.get_context("spawn")
        level = logging.getLogger("pagedllm").getEffectiveLevel()
        for i in range(self.n):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=replica_main, name=f"pagedllm-dp{i}", daemon=False, args=(self.config, i, theirs, level, self.n)
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        infos = []
        for i in range(self.n):
            infos.append((i, self._wait_ready(i)))
        return infos

    def _wait_ready(self, i: int) -> dict:
        conn, proc = self.conns[i], self.procs[i]
        ready = multiprocessing.connection.wait([conn, proc.sentinel], STARTUP_TIMEOUT_S)
        if conn in ready:
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                kind, value = "error", None
            if kind == "ready":
                return value
            raise RuntimeError(f"data-parallel replica {i} failed to start:\n{value or self.describe_death(i)}")
        proc.join(1.0)
        raise RuntimeError(f"data-parallel replica {i} {self.describe_death(i)} while starting")

    def send(self, i: int, msg: tuple) -> bool:
        try:
            self.conns[i].send(msg)
            return True
        except OSError:
            return False

    def flush(self, replicas: list[_Replica]) -> None:
        pass  # pipes deliver at once

    def receive(self, replicas: list[_Replica], timeout: float) -> list[tuple[_Replica, tuple | None]]:
        """Messages that have arrived, as (replica, message); (replica, None) for one that died."""
        if not replicas:
            return []
        by_conn = {self.conns[r.handle]: r for r in replicas}
        by_sentinel = {self.procs[r.handle].sentinel: r for r in replicas}
        ready = multiprocessing.connection.wait(list(by_conn) + list(by_sentinel), timeout)
        got: list[tuple[_Replica, tuple | None]] = []
        dead: set[int] = set()
        for obj in ready:
            if obj in by_sentinel:
                dead.add(by_sentinel[obj].index)
        for conn, replica in by_conn.items():
            try:
                while conn.poll():
                    msg = conn.recv()
                    if msg[0] == "error":
                        logger.error("data-parallel replica %d failed:\n%s", replica.index, msg[1])
                        dead.add(replica.index)
                        break
                    got.append((replica, msg))
            except (EOFError, OSError):
                dead.add(replica.index)
        got += [(r, None) for r in replicas if r.index in dead]
        return got

    def describe_death(self, i: int) -> str:
        from pagedllm.executor.child_process import describe_exit

        proc = self.procs[i]
        proc.join(2.0)
        return describe_exit(proc.exitcode)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
