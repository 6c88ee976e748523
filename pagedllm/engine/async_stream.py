"""What the AsyncLLMEngine's two threads exchange: the inbox messages (event loop -> engine
thread), the engine thread's record of each request, the stream an asyncio caller awaits, and
the errors a stream can end with."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from dataclasses import dataclass, field

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """More requests than max_num_seqs + max_queue_len are in flight."""


class RequestFailedError(RuntimeError):
    """The engine failed while this request was in flight (not the request's own fault)."""


@dataclass(slots=True)
class AddMessage:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    stream: RequestStream
    arrival: float  # time.monotonic() when generate() was called


@dataclass(slots=True)
class AbortMessage:
    request_ids: list[str]


@dataclass(slots=True)
class StreamState:
    """Engine-thread bookkeeping for one in-flight request."""

    stream: RequestStream
    arrival: float  # time.monotonic() when generate() was called
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0  # summed over the n samples
    num_prompt_tokens: int = 0
    last_output: RequestOutput | None = None

    @property
    def final_only(self) -> bool:
        """The engine reports it once, finished; timings come from its metrics."""
        return self.kind == RequestOutputKind.FINAL_ONLY


class RequestStream:
    """The asyncio side of one request: holds the newest output (cumulative outputs: a newer
    one replaces it) or the outputs not yet read (deltas: a consumer that fell behind gets
    them joined into one, as it would have got the newest cumulative one), or an error, and
    wakes the consumer. `put` / `fail` run on the stream's event loop only."""

    __slots__ = ("request_id", "loop", "delta", "_pending", "_error", "_ready", "done")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, delta: bool = False) -> None:
        self.request_id = request_id
        self.loop = loop
        self.delta = delta
        self._pending: collections.deque[RequestOutput] = collections.deque()
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.done = False  # a final output or an error has been put

    def put(self, output: RequestOutput) -> None:
        if not self.delta:
            self._pending.clear()
        self._pending.append(output)
        self.done = self.done or output.finished
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.done = True
        self._ready.set()

    async def get(self) -> RequestOutput:
        while True:
            if self._pending:
                if len(self._pending) == 1 or not self.delta:
                    return self._pending.popleft()
                joined = join_deltas(list(self._pending))
                self._pending.clear()
                return joined
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()


def join_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive DELTA outputs of one request as one: each sample's pieces concatenated (in
    index order), the rest (finish, cumulative_logprob, metrics, ...) as the newest says.
    Costs what the pieces hold, not what the request has produced so far."""
    samples: dict[int, list[CompletionOutput]] = {}
    prompt_logprobs = None
    for d in deltas:
        for c in d.outputs:
            samples.setdefault(c.index, []).append(c)
        if d.prompt_logprobs:
            prompt_logprobs = (prompt_logprobs or []) + d.prompt_logprobs
    outputs = []
    for i in sorted(samples):
        pieces = samples[i]
        last = pieces[-1]
        if len(pieces) > 1:
            lps = [lp for c in pieces for lp in (c.logprobs or ())] if last.logprobs is not None else None
            last = dataclasses.replace(
                last,
                text="".join(c.text for c in pieces),
                token_ids=[t for c in pieces for t in c.token_ids],
                logprobs=lps,
            )
        outputs.append(last)
    return dataclasses.replace(deltas[-1], outputs=outputs, prompt_logprobs=prompt_logprobs)


def abort_output(request_id: str, state: StreamState) -> RequestOutput:
    """The final output of an aborted request: its samples so far, finished with "abort"."""
    # New objects: the old ones may be in the hands of the event loop thread right now.
    # (Deltas: what was sent stays sent; the last one is empty.)
    delta = state.kind == RequestOutputKind.DELTA
    for i, c in list(state.outputs.items()):
        if c.finish_reason is None:
            c = dataclasses.replace(c, finish_reason="abort")
            if delta:
                c = dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
            state.outputs[i] = c
        elif delta:
            del state.outputs[i]  # its end was reported
    prev = state.last_output
    return RequestOutput(
        request_id=request_id,
        prompt=prev.prompt if prev else None,
        prompt_token_ids=prev.prompt_token_ids if prev else [],
        prompt_logprobs=prev.prompt_logprobs if prev and not delta else None,
        outputs=[state.outputs[i] for i in sorted(state.outputs)],
        finished=True,
        metrics=prev.metrics if prev else None,
        num_cached_tokens=prev.num_cached_tokens if prev else 0,
    )
