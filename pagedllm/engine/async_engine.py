"""AsyncLLMEngine: the offline LLMEngine driven by one background thread, for the server.

Owns the engine thread, the inbox of adds and aborts that the thread applies between steps,
and one output stream per request that asyncio code awaits. It must never call into the
LLMEngine from any other thread (the engine is not thread-safe and `step()` blocks for a whole
forward pass), and it imports no fastapi / uvicorn / prometheus.

    asyncio loop (HTTP handlers)                 engine thread
    ──────────────────────────────────           ──────────────────────────────────────────
    generate(): new RequestStream,              loop: apply inbox (add_request / abort)
                inbox ← AddMessage ─────────────────▶        outputs = engine.step()
    async for out in stream ◀─ call_soon_threadsafe ─  snapshot each output → its stream
    abort():    inbox ← AbortMessage ───────────────▶        stats → stat loggers (log line, Prometheus)

A stream of cumulative outputs (the text and tokens so far) keeps only the newest one, so a
slow consumer skips intermediate states instead of queueing them; a stream of deltas (the
server's, when it streams) keeps those not yet read and hands them over joined into one.

Failure model: a request the engine rejects (ValueError from add_request) gets that ValueError;
when `step()` raises, every in-flight request fails with RequestFailedError and is aborted, and
the loop goes on unless the engine's `check_health()` then raises (a worker or pipeline stage
died: no step can ever succeed), which stops the loop. Only if the engine cannot even be
cleaned up does the loop stop; from then on `errored` is true, `generate()` raises
EngineDeadError, and the server's /health says 503.

Tests reach both failure paths through `StepFault` (the server reads it from
$PAGEDLLM_TEST_FAULT): a chosen engine step raises, or kills the loop, before it runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.engine.async_stream import (
    AbortMessage,
    AddMessage,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    StreamState,
    abort_output,
)
from pagedllm.engine.fault_injection import StepFault
from pagedllm.engine.metrics import IterationStats, StatLogger, finished_request_stats
from pagedllm.engine.protocol import EngineClient
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.config import EngineArgs

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Serves many concurrent `generate()` streams from one LLMEngine running in a thread.

    `max_queue_len`: how many requests may wait beyond the `max_num_seqs` being served; past
    that, `generate()` raises QueueFullError (None = no limit).
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        max_num_seqs: int | None = None,
        max_queue_len: int | None = None,
        stat_loggers: Sequence[StatLogger] = (),
        idle_tick: float = 1.0,
        start: bool = True,
        step_fault: StepFault | None = None,
    ) -> None:
        if max_queue_len is not None and max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {max_queue_len}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        if max_num_seqs is None:  # the engine's own limit (data parallelism: every replica's)
            pc = engine.config.parallel_config
            max_num_seqs = engine.config.scheduler_config.max_num_seqs * pc.data_parallel_size
        self.max_num_seqs = max_num_seqs
        self.max_queue_len = max_queue_len
        self.stat_loggers = list(stat_loggers)
        self._idle_tick = idle_tick
        self._step_fault = step_fault
        self._num_steps = 0

        self._cv = threading.Condition()
        self._inbox: list[AddMessage | AbortMessage] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._dead_error: BaseException | None = None
        # Engine-thread only.
        self._requests: dict[str, StreamState] = {}
        self._last_stats: Any = None
        # Event-loop side: request ids handed to generate() and not yet ended.
        self._in_flight: set[str] = set()
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLMEngine:
        from pagedllm.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_engine_args(engine_args), **kwargs)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is in flight and stop the engine thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()  # stops tensor-parallel workers

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead_error is None

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or (
            self._thread is not None and not self._thread.is_alive() and not self._stopping
        )

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead_error!r}")

    # ---- admission ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def check_capacity(self, num_requests: int = 1) -> None:
        """Raise QueueFullError unless `num_requests` more requests fit in the queue."""
        if self.max_queue_len is None:
            return
        limit = self.max_num_seqs + self.max_queue_len
        if len(self._in_flight) + num_requests > limit:
            raise QueueFullError(
                f"the server is at capacity ({len(self._in_flight)} requests in flight, "
                f"max_num_seqs={self.max_num_seqs} + max_queue_len={self.max_queue_len}); "
                "retry later"
            )

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and return the async stream of its outputs, of the kind
        `sampling_params.output_kind` asks for (CUMULATIVE: a slow consumer gets the newest;
        DELTA: every delta, in order, those that arrived while the consumer was busy joined
        into one); the last has `finished=True`. Must be called from a
        running event loop. With `final_only` (the same as output_kind FINAL_ONLY), the
        stream yields only the final output (less work per step for a caller that does not
        stream).

        Admission happens here, synchronously (so a handler can submit several requests with no
        other handler in between): EngineDeadError, QueueFullError and a duplicate id raise at
        once; a rejection by the engine (ValueError) is raised by the stream's first item.
        Closing the stream early (a client that went away) aborts the request.
        """
        if self.errored:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead_error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if request_id in self._in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.check_capacity(1)
        if final_only and sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            sampling_params = sampling_params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        kind = sampling_params.output_kind
        stream = RequestStream(request_id, asyncio.get_running_loop(), kind == RequestOutputKind.DELTA)
        self._in_flight.add(request_id)
        self._post(AddMessage(request_id, prompt, sampling_params, priority, stream, time.monotonic()))
        return self._iterate(stream)

    async def _iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.done:
                self._post(AbortMessage([stream.request_id]))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (thread-safe, idempotent). Their streams end with finish_reason
        "abort", and their KV blocks are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if ids:
            self._post(AbortMessage(ids))

    def abort_all(self) -> None:
        self.abort_nowait(list(self._in_flight))

    @property
    def last_stats(self) -> Any:
        """The engine's stats after the latest loop pass (None before the first)."""
        return self._last_stats

    # ---- engine thread -------------------------------------------------------------------------

    def _post(self, msg: AddMessage | AbortMessage) -> None:
        with self._cv:
            self._inbox.append(msg)
            self._cv.notify()

    def _take_inbox(self, block: bool) -> list[AddMessage | AbortMessage]:
        with self._cv:
            if block and not self._inbox and not self._stopping:
                self._cv.wait(self._idle_tick)
            msgs, self._inbox = self._inbox, []
            return msgs

    def _run(self) -> None:
        logger.debug("engine loop started")
        try:
            while True:
                busy = bool(self._requests) or self.engine.has_unfinished_requests()
                msgs = self._take_inbox(block=not busy)
                if self._stopping:
                    self._abort_everything("the engine is shutting down")
                    break
                iteration = IterationStats()
                self._apply(msgs, iteration)
                if self.engine.has_unfinished_requests():
                    self._step(iteration)
                self._record(iteration)
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            self._dead_error = e
            logger.exception("the engine loop died; failing every in-flight request")
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
        logger.debug("engine loop stopped")

    def _apply(self, msgs: list[AddMessage | AbortMessage], iteration: IterationStats) -> None:
        for msg in msgs:
            if isinstance(msg, AddMessage):
                self._apply_add(msg)
            else:
                self._apply_abort(msg.request_ids, iteration)

    def _apply_add(self, msg: AddMessage) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt, msg.params, msg.arrival, msg.priority)
        except ValueError as e:
            self._deliver([(msg.stream, ValueError(str(e)))])
            return
        except Exception as e:  # noqa: BLE001 - a broken add fails that request only
            logger.exception("add_request(%s) failed", msg.request_id)
            self._deliver([(msg.stream, RequestFailedError(f"the engine could not add the request: {e!r}"))])
            return
        num_prompt = len(msg.prompt) if isinstance(msg.prompt, list) else 0
        self._requests[msg.request_id] = StreamState(
            stream=msg.stream,
            arrival=msg.arrival,
            kind=msg.params.output_kind,
            num_prompt_tokens=num_prompt,
        )

    def _apply_abort(self, request_ids: list[str], iteration: IterationStats) -> None:
        live = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
        if not live:
            return
        self.engine.abort_request(live)  # an exception here means the engine state is unknown
        now = time.monotonic()
        deliveries = []
        for rid in live:
            state = self._requests.pop(rid)
            final = abort_output(rid, state)
            deliveries.append((state.stream, final))
            iteration.finished.append(finished_request_stats(state, final, now, "abort"))
        self._deliver(deliveries)

    def _step(self, iteration: IterationStats) -> None:
        self._num_steps += 1
        try:
            if self._step_fault is not None:
                self._step_fault.before_step(self._num_steps)
            steps_before = self.engine.num_steps_scheduled
            outputs = self.engine.step()
            new_steps = self.engine.num_steps_scheduled - steps_before
            if new_steps:
                log = self.engine.step_log
                iteration.step_tokens.extend(log[-i].num_tokens for i in range(min(new_steps, len(log)), 0, -1))
        except Exception as e:  # noqa: BLE001
            ids = list(self._requests)
            logger.exception("engine step failed; failing the %d in-flight requests", len(ids))
            err = RequestFailedError(f"the engine failed while serving this request: {e!r}")
            now = time.monotonic()
            states = [self._requests.pop(rid) for rid in ids]
            try:
                # Free whatever the failed requests held; if even that fails, the loop dies.
                self.engine.abort_request(ids)
            finally:
                self._deliver([(state.stream, err) for state in states])
                iteration.finished.extend(finished_request_stats(s, None, now, "error") for s in states)
            self.engine.check_health()  # a dead worker or stage: the loop dies (and the server exits)
            return
        now = time.monotonic()
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:  # aborted on our side in the meantime
                continue
            snap = self._snapshot(state, out, now, iteration)
            if out.error is not None:
                self._requests.pop(out.request_id)
                deliveries.append((state.stream, RequestFailedError(out.error)))
                iteration.finished.append(finished_request_stats(state, snap, now, "error"))
                continue
            deliveries.append((state.stream, snap))
            if out.finished:
                self._requests.pop(out.request_id)
                fin = finished_request_stats(state, snap, now, None)
                iteration.finished.append(fin)
                if state.final_only and fin.time_to_first_token is not None:
                    iteration.time_to_first_tokens.append(fin.time_to_first_token)
        self._deliver(deliveries)

    def _snapshot(self, state: StreamState, out: RequestOutput, now: float, iteration: IterationStats) -> RequestOutput:
        # The engine builds fresh output objects (and lists) every step, so they can be handed to
        # the event loop thread as they are.
        delta = state.kind == RequestOutputKind.DELTA
        new_tokens = 0
        for c in out.outputs:
            prev = state.outputs.get(c.index)
            new_tokens += len(c.token_ids) - (len(prev.token_ids) if prev and not delta else 0)
            state.outputs[c.index] = c
        if new_tokens > 0 and not state.final_only:
            if state.first_token_time is None:
                state.first_token_time = now
                iteration.time_to_first_tokens.append(now - state.arrival)
            elif state.last_token_time is not None:
                iteration.inter_token_latencies.append((now - state.last_token_time) / new_tokens)
            state.last_token_time = now
        state.num_tokens += max(new_tokens, 0)
        state.num_prompt_tokens = len(out.prompt_token_ids)
        if delta:  # passed on as it is: the stream queues every delta
            state.last_output = out
            return out
        snap = RequestOutput(
            request_id=out.request_id,
            prompt=out.prompt,
            prompt_token_ids=out.prompt_token_ids,
            prompt_logprobs=out.prompt_logprobs,
            outputs=[state.outputs[i] for i in sorted(state.outputs)],
            finished=out.finished,
            metrics=out.metrics,
            num_cached_tokens=out.num_cached_tokens,
            error=out.error,
        )
        state.last_output = snap
        return snap

    def _record(self, iteration: IterationStats) -> None:
        try:
            self._last_stats = self.engine.get_stats()
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.exception("get_stats() failed")
            self._last_stats = None
        now = time.monotonic()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self._last_stats, iteration, now)
            except Exception:  # noqa: BLE001
                logger.exception("stat logger %r failed", stat_logger)

    def _abort_everything(self, why: str) -> None:
        ids = list(self._requests)
        if ids:
            logger.info("aborting %d in-flight requests: %s", len(ids), why)
            iteration = IterationStats()
            self._apply_abort(ids, iteration)
        with self._cv:
            pending, self._inbox = self._inbox, []
        self._deliver([(m.stream, EngineDeadError(why)) for m in pending if isinstance(m, AddMessage)])

    def _fail_all(self, error: BaseException) -> None:
        deliveries = [(s.stream, error) for s in self._requests.values()]
        self._requests.clear()
        with self._cv:
            pending, self._inbox = self._inbox, []
        deliveries += [(m.stream, error) for m in pending if isinstance(m, AddMessage)]
        self._deliver(deliveries)

    def _deliver(self, items: Sequence[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams' event loops: one thread-safe call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver_on_loop, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _deliver_on_loop(self, batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream, item in batch:
            if isinstance(item, BaseException):
                stream.fail(item)
            else:
                stream.put(item)
            if stream.done:
                self._in_flight.discard(stream.request_id)
