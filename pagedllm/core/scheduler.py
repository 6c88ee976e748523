"""Continuous batching under one token budget per step.

Token accounting: a request's `num_computed_tokens` advances when a step is scheduled (its
K/V will be written by that step). A step that reaches the end of a request's known tokens
samples one; until the runner's output arrives that token is pending (`num_pending`), which
lets the engine schedule step N+1 while step N still runs on the GPU (asynchronous
scheduling). A request that stopped at step N may thus be computed once more in step N+1;
that output is dropped.

Each step serves the running requests first (a decode is one token; a request still in its
prompt gets the next chunk), then swapped-out requests, then admits waiting ones, cutting a
long prompt into chunks that fit the budget (chunked prefill). When the block pool runs dry,
the lowest-priority running request that is not yet scheduled this step is preempted (the
newest one under FCFS), by recompute (free its blocks, queue it again) or by swap (copy its
blocks to the CPU pool). The scheduler never touches tensors.

With `pipeline_parallel`, several scheduled batches are in flight at once (one per stage) and
a request belongs to at most one of them: from `schedule()` until `update_from_output()` of
that batch it is skipped, never preempted, and its next step carries the tokens the workers
have not seen (`new_token_ids`), since only the last stage sampled them.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        pipeline_parallel: bool = False,
    ) -> None:
        self.config = scheduler_config
        self.pipeline_parallel = pipeline_parallel
        self.in_flight: set[str] = set()  # pipeline parallelism: requests of the batches in flight
        self._num_tokens_sent: dict[str, int] = {}  # pipeline parallelism: tokens the workers know
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(
            num_gpu_blocks, cache_config.block_size, cache_config.enable_prefix_caching, num_cpu_blocks
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_needing_history = 0  # live requests whose sampling reads their output history
        self.priority = scheduler_config.scheduling_policy == "priority"

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.num_needing_history += request.needs_history
        request.status = RequestStatus.WAITING
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request, front: bool = False) -> None:
        if self.priority:
            self.waiting.append(request)
            self.waiting = deque(sorted(self.waiting, key=Request.sort_key))
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: str | list[str] | set[str], status: RequestStatus) -> list[Request]:
        """Abort, or stop for a reason found outside the scheduler (a stop string). Frees the
        request's blocks at once. Unknown or already finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING:
                self.waiting.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            self._free(req, status)
            done.append(req)
        return done

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.num_needing_history -= req.needs_history
        self.block_manager.free(req)
        self.block_manager.free_swapped(req)
        self.requests.pop(req.request_id, None)
        self._num_tokens_sent.pop(req.request_id, None)
        self._finished_since_last_step.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def batch_wait_remaining(self, now: float | None = None) -> float:
        """Seconds an idle engine should still wait for more requests before it starts a
        batch (`batch_wait_timeout`); 0 when it should run now."""
        timeout = self.config.batch_wait_timeout / 1000.0
        if timeout <= 0 or self.running or self.swapped or not self.waiting:
            return 0.0
        if len(self.waiting) >= self.config.max_num_seqs:
            return 0.0
        now = time.monotonic() if now is None else now
        oldest = min(r.arrival_time for r in self.waiting)
        return max(0.0, oldest + timeout - now)

    # ---- scheduling ---------------------------------------------------------------------
    def _pick_victim(self, current_index: int) -> Request | None:
        """The request to preempt: among the running ones not yet scheduled this step
        (and the current one), the lowest priority, i.e. the newest under FCFS; never one
        in a batch in flight (None when only such ones are left)."""
        candidates = [r for r in self.running[current_index:] if r.request_id not in self.in_flight]
        if not candidates:
            return None
        if self.priority:
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        req.num_preemptions += 1
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out(req):
            out.blocks_to_swap_out.extend(bm.swap_out(req))
            self.num_swap_outs += 1
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
        else:
            bm.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self._enqueue_waiting(req, front=True)
        logger.debug("preempted %s (%s)", req.request_id, req.status.name)

    def _new_request_data(self, req: Request) -> NewRequestData:
        if self.pipeline_parallel:
            self._num_tokens_sent[req.request_id] = len(req.all_token_ids)
        return NewRequestData(
            req_id=req.request_id,
            token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            block_ids=list(self.block_manager.get_block_ids(req.request_id)),
            num_computed_tokens=req.num_computed_tokens,
            sampling_params=req.sampling_params,
            eos_token_ids=req.eos_token_ids,
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        if self.batch_wait_remaining() > 0:
            return out
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        max_len = self.config.max_model_len
        now = time.monotonic()  # first_scheduled_time, on the requests' clock
        preempted = False

        # 1. running requests, oldest first (this loop runs for every running request every
        # step: properties are spelled out and nothing is allocated for a decode that needs no
        # new block)
        i = 0
        in_flight = self.in_flight
        req_blocks = bm.req_blocks
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if in_flight and req.request_id in in_flight:
                i += 1  # pipeline parallelism: in a batch still in flight
                continue
            num_with_pending = len(req.all_token_ids) + req.num_pending
            if req.num_pending and (
                len(req.output_token_ids) + req.num_pending >= req.max_output_tokens or num_with_pending >= max_len
            ):
                i += 1  # its last token is in flight: it finishes when that arrives
                continue
            num_new = min(num_with_pending - req.num_computed_tokens, budget, max_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            old_len = len(req_blocks.get(req.request_id, ()))
            scheduled = True
            while not bm.allocate_slots(req, num_new):
                victim = self._pick_victim(i)
                if victim is None:  # only requests in flight hold blocks: wait for them
                    scheduled = False
                    budget = 0
                    break
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue
            table = req_blocks[req.request_id]
            cached = CachedRequestData(
                req.request_id, table[old_len:] if len(table) > old_len else (), req.num_computed_tokens
            )
            if self.pipeline_parallel:
                sent = self._num_tokens_sent[req.request_id]
                cached.new_token_ids = req.all_token_ids[sent:]
                self._num_tokens_sent[req.request_id] = len(req.all_token_ids)
            out.scheduled_cached_reqs.append(cached)
            self._advance(req, num_new, out)
            budget -= num_new
            i += 1

        # 2. swapped-out requests come back before new ones are admitted
        while self.swapped and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not bm.can_swap_in(req, num_new):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(bm.swap_in(req))
            ok = bm.allocate_slots(req, num_new)
            assert ok, "can_swap_in guaranteed room"
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled_new_reqs.append(self._new_request_data(req))
            self._advance(req, num_new, out)
            budget -= num_new

        # 3. waiting requests, with prefix-cache hits and chunked prefill
        while (
            self.waiting
            and not preempted
            and not self.swapped
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            hits = bm.get_computed_blocks(req)
            num_computed = len(hits) * self.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            if not bm.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
                bm.record_prefix_query(req.num_tokens, num_computed)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled_new_reqs.append(self._new_request_data(req))
            self._advance(req, num_new, out)
            budget -= num_new

        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if self.pipeline_parallel:
            self.in_flight.update(out.num_scheduled_tokens)
        return out

    @staticmethod
    def _advance(req: Request, num_new: int, out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[req.request_id] = num_new
        num_with_pending = len(req.all_token_ids) + req.num_pending
        if num_new == 1 and req.num_computed_tokens + 1 == num_with_pending:
            out.num_decodes += 1
        else:
            out.num_prefill_tokens += num_new
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == num_with_pending:
            req.num_pending += 1  # this step samples the next token

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[tuple[Request, int | None]]:
        """Append the sampled tokens and apply token-level stops (EOS, stop_token_ids,
        max_tokens, max_model_len). Returns (request, new token or None) for every scheduled
        request still alive; finished ones have already released their blocks. A request
        preempted since the step was scheduled still receives its token."""
        results = []
        sampled = runner_out.sampled_token_ids
        if self.pipeline_parallel:
            self.in_flight.difference_update(sched_out.num_scheduled_tokens)
        requests, max_len = self.requests, self.config.max_model_len
        for rid in sched_out.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted while the step ran
            token = sampled.get(rid)
            if token is not None:
                req.num_pending -= 1
                req.append_output_token(token)
                status = req.check_stop(max_len)
                if status is not None:
                    self.finish_requests(rid, status)
            results.append((req, token))
        return results

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            n = len(self.block_manager.get_block_ids(req.request_id))
            assert n >= self.block_manager.num_blocks_needed(req.num_computed_tokens)
        for req in self.waiting:
            assert req.request_id not in self.block_manager.req_blocks
        assert len(self.running) <= self.config.max_num_seqs
