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
from pagedllm.engine.detokenizer import IncrementalDetokenizer, can_defer, decode_final
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_FINISHED = RequestStatus.FINISHED_STOPPED  # a status at least this is finished
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass(slots=True)
class _Sample:
    """One child sequence's output state."""

    index: int
    request: Request
    # None: no tokenizer, or (`deferred`) the text is decoded once at the end
    detok: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    cum_logprob: float | None
    deferred: bool = False
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
    final_only: bool = False

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
        for i, child in enumerate(children):
            cp = child.sampling_params
            # FINAL_ONLY without stop strings needs no text before the end: decode it once then
            deferred = kind == _FINAL_ONLY and not cp.stop and can_defer(cp) and self.tokenizer is not None
            detok = IncrementalDetokenizer(self.tokenizer, cp) if self.tokenizer is not None and not deferred else None
            lps: list[dict[int, Logprob]] | None = [] if cp.logprobs is not None else None
            samples.append(_Sample(i, child, detok, lps, 0.0 if lps is not None else None, deferred))
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            kind,
            samples,
            RequestMetrics(arrival_time=arrival),
            [None] if params.prompt_logprobs is not None else None,
            final_only=kind == _FINAL_ONLY,
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
        ends a child whose stop string appeared (the scheduler frees its blocks).

        This runs once per request per step: a FINAL_ONLY request that is not finishing costs
        a lookup, its timing and its counts (no output, no text), and nothing here copies what a
        request has produced so far."""
        now = time.monotonic()
        child = self._child
        lp_map = runner_out.logprobs
        plp_map = runner_out.prompt_logprobs
        due: dict[str, RequestState] = {}  # the requests with an output to make
        num_generated = 0
        for req, token in results:
            entry = child.get(req.request_id)
            if entry is None:
                continue
            state, sample = entry
            m = state.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = req.first_scheduled_time
                m.time_in_queue = (req.first_scheduled_time or now) - m.arrival_time
                self.prompt_tokens_total += len(state.prompt_token_ids)
            if plp_map and state.prompt_logprobs is not None and sample is state.samples[0]:
                plp = plp_map.get(req.request_id)
                if plp is not None:
                    state.prompt_logprobs.extend(self.logprob_dicts(plp))
            if token is None:
                if not state.final_only:
                    due[state.request_id] = state
                continue
            num_generated += 1
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if sample.logprobs is not None:
                lp = lp_map.get(req.request_id)
                if lp is not None:
                    sample.logprobs.append(self.logprob_dicts([lp])[0])  # type: ignore[arg-type]
                    sample.cum_logprob += lp.logprob  # type: ignore[operator]
            detok = sample.detok
            if detok is not None:
                stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
                stop_str = detok.update(token, not stopped_by_token or req.sampling_params.include_stop_str_in_output)
                if stop_str is not None and req.status < _FINISHED:
                    stop(req.request_id)
                    req.stop_reason = stop_str
            if req.status >= _FINISHED:
                state.num_finished += 1
                m.num_preemptions += req.num_preemptions
                due[state.request_id] = state
            elif not state.final_only:
                due[state.request_id] = state
        self.generation_tokens_total += num_generated
        outputs = []
        for state in due.values():
            fin = state.finished
            if state.final_only and not fin:
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
        if state.kind == RequestOutputKind.DELTA:
            return self._delta_output(state)
        copy = state.kind == RequestOutputKind.CUMULATIVE
        completions = []
        for s in state.samples:
            child = s.request
            fin = child.status >= _FINISHED
            ids = child.output_token_ids
            lps = s.logprobs
            if s.detok is not None:
                text = s.detok.visible_text(fin)
            elif s.deferred and fin:
                stopped_by_token = child.status == RequestStatus.FINISHED_STOPPED and ids
                keep = ids[:-1] if stopped_by_token and not child.sampling_params.include_stop_str_in_output else ids
                text = decode_final(self.tokenizer, child.sampling_params, keep)
            else:
                text = ""
            if copy:
                ids = list(ids)
                lps = list(lps) if lps is not None else None
            completions.append(self._completion(s, text, ids, lps, fin))
        plp = state.prompt_logprobs
        if copy and plp is not None:
            plp = list(plp)
        return self._request_output(state, completions, plp)

    def _delta_output(self, state: RequestState) -> RequestOutput | None:
        """What is new since the previous output: O(new), whatever the length so far."""
        completions = []
        for s in state.samples:
            if s.reported_final:
                continue
            child = s.request
            fin = child.status >= _FINISHED
            ids = child.output_token_ids
            detok = s.detok
            end = detok.visible_len(fin) if detok is not None else 0
            num_new = len(ids) - s.sent_tokens
            if not num_new and end == s.sent_text and not fin:
                continue  # nothing new for this sample
            text = detok.text[s.sent_text : end] if detok is not None and end > s.sent_text else ""
            new_ids = ids[s.sent_tokens :] if num_new else []
            lps = s.logprobs[s.sent_tokens :] if s.logprobs is not None else None
            if end > s.sent_text:
                s.sent_text = end
            s.sent_tokens = len(ids)
            s.reported_final = fin
            completions.append(self._completion(s, text, new_ids, lps, fin))
        plp = state.prompt_logprobs
        if plp is not None:
            plp, state.sent_prompt_logprobs = plp[state.sent_prompt_logprobs :], len(plp)
        if not completions and not plp:
            return None
        return self._request_output(state, completions, plp)

    @staticmethod
    def _completion(
        s: _Sample, text: str, ids: list[int], lps: list[dict[int, Logprob]] | None, fin: bool
    ) -> CompletionOutput:
        child = s.request
        return CompletionOutput(
            s.index,
            text,
            ids,
            s.cum_logprob,
            lps,
            child.status.finish_reason if fin else None,
            child.stop_reason if fin else None,
        )

    @staticmethod
    def _request_output(
        state: RequestState, completions: list[CompletionOutput], plp: list[dict[int, Logprob] | None] | None
    ) -> RequestOutput:
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            plp,
            completions,
            state.num_finished == len(state.samples),
            state.metrics,
            max(state.samples[0].request.num_cached_tokens, 0),
        )
