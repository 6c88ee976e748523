"""The engine's step under pipeline parallelism: up to one batch per stage in flight (vLLM's
virtual engines), the oldest read back each step. A request is in one batch at a time, so a
batch holds the requests that are not in flight:

    stage 0: | B1 | B2 | B3 | B1'|          (B1' = B1's requests, one token on)
    stage 1:      | B1 | B2 | B3 | B1'|
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


def step_pipelined(engine: LLMEngine) -> list[RequestOutput]:
    tm, clock = engine.step_timing, time.perf_counter
    q = engine._pipeline
    while len(q) < engine.pipeline_depth:
        t0 = clock()
        so = engine.scheduler.schedule()
        t1 = clock()
        tm.schedule += t1 - t0
        if so.is_empty:
            if so.finished_req_ids:
                engine.executor.execute_model(so)  # let the workers drop finished state
            break
        q.append((so, engine._launch(so)))
        tm.launch += clock() - t1
    if not q:
        wait = engine.scheduler.batch_wait_remaining()
        if wait > 0:
            time.sleep(min(wait, 0.002))
        return []
    t0 = clock()
    so, handle = q.popleft()
    runner_out = engine.executor.collect(handle)
    t1 = clock()
    outputs = engine._process(so, runner_out)
    tm.collect += t1 - t0
    tm.process += clock() - t1
    tm.steps += 1
    while q and not engine.has_unfinished_requests():  # nothing left to report: drain the batches in flight
        so, handle = q.popleft()
        engine.scheduler.update_from_output(so, engine.executor.collect(handle))
    return outputs
