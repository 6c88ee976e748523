"""OutputProcessor: the engine's side of a request after the scheduler: its detokenizers and
stop strings, its logprob dicts, its timing, and the RequestOutputs it is reported by, of the
kind its SamplingParams ask for (`output_kind`):

    CUMULATIVE   every step: all text, token ids and logprobs so far (fresh lists each time,
                 so an output may be handed to another thread)
    DELTA        every step that added something: only what is new since the previous output
                 (prompt logprobs in the first); cumulative_logprob stays the running sum
    FINAL_ONLY   once, when every sample has finished; nothing is copied per step, and
                 without stop strings the text is decoded once at the end

A request with `n > 1` is n child sequences (the scheduler's Requests); its RequestOutput
gathers them. Request timing is on one clock, `time.monotonic()` (RequestMetrics' fields too:
unlike vLLM's wall-clock times they are for differences, and the AsyncLLMEngine's latencies
are on the same clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class _Sample:
    """One child sequence's output state."""

    request: Request
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cum_logprob: float | None
    sent_tokens: int = 0  # DELTA: what earlier outputs carried
    sent_text: int = 0
    reported_final: bool = False  # DELTA: its finish was reported


@dataclass(slots=True)
class RequestState:
    """One user request and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    sent_prompt_logprobs: int = 0  # DELTA: prompt positions already reported
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._child: dict[str, tuple[RequestState, _Sample]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        children: list[Request],
        arrival: float,
    ) -> None:
        kind = params.output_kind
        samples = []
        for child in children:
            cp = child.sampling_params
            # FINAL_ONLY without stop strings needs no text before the end: decode it once then
            deferred = kind == RequestOutputKind.FINAL_ONLY and not cp.stop
            detok = IncrementalDetokenizer(self.tokenizer, cp, deferred) if self.tokenizer is not None else None
            samples.append(
                _Sample(child, detok, [] if cp.logprobs is not None else None, 0.0 if cp.logprobs is not None else None)
            )
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            kind,
            samples,
            RequestMetrics(arrival_time=arrival),
            [None] if params.prompt_logprobs is not None else None,
        )
        self.requests[request_id] = state
        for s in samples:
            self._child[s.request.request_id] = (state, s)

    def remove(self, request_id: str) -> list[str]:
        """Forgets a request; returns its children's ids (for the scheduler to free)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        ids = [s.request.request_id for s in state.samples]
        for cid in ids:
            self._child.pop(cid, None)
        return ids

    def process(
        self, results: list[tuple[Request, int | None]], runner_out: ModelRunnerOutput, stop: Callable[[str], None]
    ) -> list[RequestOutput]:
        """The scheduler's (request, new token) pairs of one step -> the outputs due. `stop`
        ends a child whose stop string appeared (the scheduler frees its blocks)."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for req, token in results:
            entry = self._child.get(req.request_id)
            if entry is None:
                continue
            state, sample = entry
            touched[state.request_id] = state
            m = state.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = req.first_scheduled_time
                m.time_in_queue = (req.first_scheduled_time or now) - m.arrival_time
                self.prompt_tokens_total += len(state.prompt_token_ids)
            plp = runner_out.prompt_logprobs.get(req.request_id)
            if plp is not None and sample is state.samples[0] and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self.logprob_dicts(plp))
            if token is None:
                continue
            self.generation_tokens_total += 1
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if sample.logprobs is not None:
                lp = runner_out.logprobs.get(req.request_id)
                if lp is not None:
                    sample.logprobs.append(self.logprob_dicts([lp])[0])  # type: ignore[arg-type,list-item]
                    sample.cum_logprob += lp.logprob  # type: ignore[operator]
            if sample.detok is not None:
                stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
                detok = not stopped_by_token or req.sampling_params.include_stop_str_in_output
                stop_str = sample.detok.update(token, detokenize=detok)
                if stop_str is not None and not req.status.finished:
                    stop(req.request_id)
                    req.stop_reason = stop_str
            if req.status.finished:
                state.num_finished += 1
                m.num_preemptions += req.num_preemptions
        outputs = []
        for state in touched.values():
            fin = state.finished
            if state.kind == RequestOutputKind.FINAL_ONLY and not fin:
                continue
            out = self._output(state)
            if fin:
                state.metrics.finished_time = now
                self.remove(state.request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def logprob_dicts(self, items: Sequence[TokenLogprobs | None]) -> list[dict[int, Logprob] | None]:
        out: list[dict[int, Logprob] | None] = []
        tok = self.tokenizer
        for it in items:
            if it is None:
                out.append(None)
                continue
            d = {it.token_id: Logprob(it.logprob, it.rank, tok.decode([it.token_id]) if tok is not None else None)}
            for r, (tid, lp) in enumerate(zip(it.top_ids, it.top_logprobs), start=1):
                if tid not in d:
                    d[tid] = Logprob(lp, r, tok.decode([tid]) if tok is not None else None)
            out.append(d)
        return out

    def _output(self, state: RequestState) -> RequestOutput | None:
        delta = state.kind == RequestOutputKind.DELTA
        copy = state.kind == RequestOutputKind.CUMULATIVE
        completions = []
        for i, s in enumerate(state.samples):
            child = s.request
            fin = child.status.finished
            text = s.detok.visible_text(fin) if s.detok is not None else ""
            ids = child.output_token_ids
            lps = s.logprobs
            if delta:
                if s.reported_final or (len(ids) == s.sent_tokens and len(text) == s.sent_text and not fin):
                    continue  # nothing new for this sample
                text, ids = text[s.sent_text :], ids[s.sent_tokens :]
                lps = lps[s.sent_tokens :] if lps is not None else None
                s.sent_text += len(text)
                s.sent_tokens += len(ids)
                s.reported_final = fin
            elif copy:
                ids = list(ids)
                lps = list(lps) if lps is not None else None
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=ids,
                    cumulative_logprob=s.cum_logprob,
                    logprobs=lps,
                    finish_reason=child.status.finish_reason if fin else None,
                    stop_reason=child.stop_reason if fin else None,
                )
            )
        plp = state.prompt_logprobs
        if plp is not None:
            if delta:
                plp, state.sent_prompt_logprobs = plp[state.sent_prompt_logprobs :], len(plp)
            elif copy:
                plp = list(plp)
        if delta and not completions and not plp:
            return None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=plp,
            outputs=completions,
            finished=state.finished,
            metrics=state.metrics,
            num_cached_tokens=max(state.samples[0].request.num_cached_tokens, 0),
        )
