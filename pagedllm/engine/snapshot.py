"""A read-only picture of an LLMEngine for the engine page and the scrape-time metrics: the KV
block map, the queues, the recent steps, the cache's internal fragmentation.

It is taken from another thread than the engine's, without a lock and without stopping the
engine: every read is of a whole Python object (`list(...)` of a list or a dict's items is one
C call under the GIL), so a snapshot may mix two adjacent steps but never raises. It costs a
pass over the block list (about 3 ms for 70,000 blocks), so callers bound its rate
(`SnapshotCache`): the engine's step path does no work for it.

Block states, one character each in `block_map`:

    '.' free, never filled     'c' free, holds a cached prefix (reusable until evicted)
    'u' in use by one request  's' shared by several requests (prefix or n > 1)
"""

from __future__ import annotations

import threading
import time
from typing import Any

_RUNNING_ROWS = 64  # requests listed individually on the page
_STEP_ROWS = 256  # the newest step records in a snapshot (readers keep those they lack)


def _block_map(blocks: list[Any]) -> str:
    chars = []
    for b in blocks:
        ref = b.ref_cnt
        chars.append("u" if ref == 1 else "s" if ref > 1 else ("c" if b.block_hash is not None else "."))
    return "".join(chars)


def kv_fragmentation(engine: Any) -> float:
    """Internal fragmentation of the KV cache: the share of the slots in blocks held by running
    requests that hold no token (the unfilled tail of each request's last block)."""
    sched = getattr(engine, "scheduler", None)
    if sched is None:  # data parallelism: the replicas' schedulers live in their own processes
        return 0.0
    bm = sched.block_manager
    allocated = used = 0
    for req in list(sched.running):
        n_blocks = len(bm.req_blocks.get(req.request_id, ()))
        allocated += n_blocks * bm.block_size
        used += min(req.num_computed_tokens, n_blocks * bm.block_size)
    return (allocated - used) / allocated if allocated else 0.0


def engine_snapshot(engine: Any) -> dict[str, Any]:
    """The state of `engine` (an LLMEngine) as plain JSON-able data; `steps` holds the newest
    step records (readers keep the indices they have not seen)."""
    sched = engine.scheduler
    bm = sched.block_manager
    cfg = engine.config
    running = list(sched.running)
    rows = []
    for req in running[:_RUNNING_ROWS]:
        rows.append(
            {
                "id": req.request_id,
                "prompt_tokens": req.num_prompt_tokens,
                "output_tokens": req.num_output_tokens,
                "computed_tokens": req.num_computed_tokens,
                "blocks": len(bm.req_blocks.get(req.request_id, ())),
                "cached_tokens": max(req.num_cached_tokens, 0),
            }
        )
    steps = [
        {
            "index": r.index,
            "time": r.time,
            "prefill_tokens": r.num_prefill_tokens,
            "decodes": r.num_decodes,
            "tokens": r.num_tokens,
            "reqs": r.num_reqs,
        }
        for r in list(engine.step_log)[-_STEP_ROWS:]
    ]
    stats = engine.get_stats()
    return {
        "time": time.time(),
        "model": engine.model_config.served_model_name,
        "device": cfg.device,
        "block_size": bm.block_size,
        "num_blocks": bm.num_blocks,
        "block_map": _block_map(list(bm.blocks)),
        "num_cpu_blocks": bm.num_cpu_blocks,
        "num_cpu_blocks_used": bm.num_cpu_blocks - len(bm.cpu_free),
        "kv_cache_usage": stats.kv_cache_usage,
        "kv_fragmentation": kv_fragmentation(engine),
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "queues": {"waiting": stats.num_waiting, "running": stats.num_running, "swapped": stats.num_swapped},
        "running": rows,
        "steps": steps,
        "last_step": engine.num_steps_scheduled,
        "counters": {
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_preemptions": stats.num_preemptions,
        },
    }


class SnapshotCache:
    """Shares one snapshot among all readers for `min_interval` seconds, so the cost of watching
    does not grow with the number of pages open."""

    def __init__(self, engine: Any, min_interval: float = 0.5) -> None:
        self.engine = engine
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._taken = 0.0
        self._value: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._value is None or now - self._taken >= self.min_interval:
                self._value = engine_snapshot(self.engine)
                self._taken = now
            return self._value
