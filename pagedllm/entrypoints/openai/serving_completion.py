"""POST /v1/completions: one engine request per prompt (a string, a list of strings, a list of
token ids or a list of those), `n` samples each; choice index = prompt index * n + sample index.

Streaming sends each choice's new text as it grows (never text that could still turn out to be
the start of a stop string), then its finish reason, then usage if asked, then [DONE].

`echo` with `max_tokens=0` (lm-eval's loglikelihood) scores the prompt only: the engine
samples one token, which the response leaves out. `prompt_logprobs` comes back per choice in
vLLM's shape.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    APIError,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, to_api_error
from pagedllm.entrypoints.openai.streaming import (
    SSE_DONE,
    ClientDisconnected,
    TextChunks,
    TextDeltas,
    cancel_on_disconnect,
    prepend,
    sse,
    sse_error,
)
from pagedllm.entrypoints.openai.structured_outputs import request_structured_outputs
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Any) -> Response:
        model_name = self.check_model(req.model)
        self.check_common_unsupported(req)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported", param="best_of")
        self.check_logprobs(req.logprobs, "logprobs")
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise APIError("max_tokens=0 needs echo=true (the prompt's logprobs are all there is to return)",
                           param="max_tokens")
        if score_only and req.stream:
            raise APIError("max_tokens=0 cannot be streamed", param="max_tokens")
        so = request_structured_outputs(req)
        await self.compile_grammar(so, "response_format" if req.response_format else "structured_outputs")

        prompts = [(text, self.truncate(ids, req)) for text, ids in await self._prompts(req.prompt)]
        params = []
        for _, ids in prompts:
            self.validate_prompt_ids(ids)
            max_tokens = 1 if score_only else self.resolve_max_tokens(req.max_tokens, len(ids), "max_tokens")
            prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
            if req.prompt_logprobs is not None:
                prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs)
            params.append(
                self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs,
                                     structured_outputs=so)
            )
        request_id = random_id("cmpl")
        created = int(time.time())
        stream = self.submit([ids for _, ids in prompts], params, request_id, req.priority)
        if req.stream:
            try:  # the first token may be a long prefill away: watch the client meanwhile
                first = await cancel_on_disconnect(self.first_item(stream), raw_request)
            except ClientDisconnected:
                return Response(status_code=499)
            body = self._stream(req, request_id, created, model_name, prepend(first, stream), prompts)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            finals = await cancel_on_disconnect(self._collect(stream, len(prompts)), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - engine failures become OpenAI errors
            raise to_api_error(e) from None
        if score_only:
            finals = [_without_outputs(f) for f in finals]
        return JSONResponse(self._response(req, request_id, created, model_name, prompts, finals).model_dump())

    async def _prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt."""
        if isinstance(prompt, str):
            return [(prompt, await self.tokenize(prompt))]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if isinstance(prompt[0], str):
            return [(p, await self.tokenize(p)) for p in prompt]
        return [(None, list(p)) for p in prompt]

    @staticmethod
    async def _collect(stream: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in stream:
            finals[i] = out
        return [finals[i] for i in range(num_prompts)]

    async def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else await self.detokenize(ids)

    # ---- non-streaming ----------------------------------------------------------------------------

    def _response(
        self,
        req: CompletionRequest,
        request_id: str,
        created: int,
        model_name: str,
        prompts: list[tuple[str | None, list[int]]],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        num_prompt_tokens = num_generated = num_cached = 0
        for p_idx, (out, (text, ids)) in enumerate(zip(finals, prompts)):
            num_prompt_tokens += len(ids)
            num_cached += out.num_cached_tokens
            plp = self._vllm_prompt_logprobs(out) if req.prompt_logprobs is not None else None
            prompt_text = "" if not req.echo else (text if text is not None else self.tokenizer.decode(ids))
            for c in out.outputs:
                num_generated += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    if req.echo:
                        self._add_logprobs(logprobs, ids, out.prompt_logprobs, req.logprobs, 0)
                    offset = len(prompt_text)
                    self._add_logprobs(logprobs, c.token_ids, c.logprobs, req.logprobs, offset)
                choices.append(
                    CompletionResponseChoice(
                        index=p_idx * req.n + c.index,
                        text=prompt_text + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=plp,
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        usage = self.usage(num_prompt_tokens, num_generated, num_cached)
        return CompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage)

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict[int, dict[str, Any]] | None]:
        steps = out.prompt_logprobs or []
        res: list[dict[int, dict[str, Any]] | None] = [None]  # the first token has no context
        for step in steps[1:] if steps and steps[0] is None else steps:
            res.append(None if step is None else {
                t: {"logprob": self.clamp(lp.logprob), "rank": lp.rank, "decoded_token": self.token_str(t, lp)}
                for t, lp in step.items()
            })
        return res[: len(out.prompt_token_ids)]

    def _add_logprobs(
        self,
        into: CompletionLogProbs,
        token_ids: list[int],
        steps: list[dict[int, Logprob] | None] | None,
        num_top: int,
        offset: int,
    ) -> None:
        """Append one entry per token. A position without logprobs (the first prompt token, or an
        engine that gave none) gets None."""
        if into.text_offset:
            offset = into.text_offset[-1] + len(into.tokens[-1])
        for pos, tid in enumerate(token_ids):
            step = steps[pos] if steps is not None and pos < len(steps) else None
            lp = step.get(tid) if step else None
            token = self.token_str(tid, lp)
            into.tokens.append(token)
            into.text_offset.append(offset)
            offset += len(token)
            if step is None:
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            into.token_logprobs.append(self.clamp(lp.logprob) if lp is not None else None)
            top = {self.token_str(t, l): self.clamp(l.logprob) for t, l in self.top_entries(step, num_top)}
            if lp is not None:
                top.setdefault(token, self.clamp(lp.logprob))
            into.top_logprobs.append(top)

    # ---- streaming --------------------------------------------------------------------------------

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        created: int,
        model_name: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        prompts: list[tuple[str | None, list[int]]],
    ) -> AsyncIterator[str]:
        n = req.n
        num_choices = len(prompts) * n
        texts = [TextDeltas() for _ in range(num_choices)]
        finished = [False] * num_choices
        started = [False] * num_choices
        num_tokens = [0] * num_choices  # generated so far
        generated = [0] * num_choices  # as of each choice's latest chunk (what usage counts)
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = include_usage and bool(opts and opts.continuous_usage_stats)
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        # echo with logprobs: each prompt's logprobs, which DELTA outputs carry only once
        prompt_logprobs: list[list] = [[] for _ in prompts]
        plain = TextChunks(lambda i, text: CompletionStreamResponse(
            id=request_id, created=created, model=model_name, choices=[CompletionResponseChoice(index=i, text=text)]))
        try:
            # each output holds only what is new (DELTA), of the samples that have something new
            async for p_idx, out in outputs:
                if req.echo and out.prompt_logprobs:
                    prompt_logprobs[p_idx].extend(out.prompt_logprobs)
                for c in out.outputs:
                    i = p_idx * n + c.index
                    num_tokens[i] += len(c.token_ids)
                    if finished[i]:
                        continue
                    done = c.finish_reason is not None
                    sent = texts[i].sent
                    delta = texts[i].take(c.text, done)
                    new_ids = c.token_ids
                    if not delta and not done and not (new_ids and req.logprobs is not None):
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = CompletionLogProbs()
                        if req.echo and not started[i]:
                            self._add_logprobs(logprobs, prompts[p_idx][1], prompt_logprobs[p_idx] or None,
                                               req.logprobs, 0)
                        self._add_logprobs(logprobs, new_ids, c.logprobs, req.logprobs, sent)
                    if req.echo and not started[i]:
                        text, ids = prompts[p_idx]
                        delta = (await self._prompt_text(text, ids)) + delta
                    started[i] = True
                    generated[i] = num_tokens[i]
                    finished[i] = done
                    if not done and logprobs is None and not continuous_usage:
                        frame = plain.frame(i, delta)
                        if frame is not None:
                            yield frame
                            continue
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=model_name,
                        choices=[
                            CompletionResponseChoice(
                                index=i,
                                text=delta,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                    )
                    if continuous_usage:
                        chunk.usage = _usage(num_prompt_tokens, sum(generated))
                    yield sse(chunk)
            if include_usage:
                yield sse(
                    CompletionStreamResponse(
                        id=request_id, created=created, model=model_name, choices=[],
                        usage=_usage(num_prompt_tokens, sum(generated)),
                    )
                )
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in the stream
            yield sse_error(to_api_error(e))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE


def _without_outputs(out: RequestOutput) -> RequestOutput:
    """max_tokens=0: the one token sampled to score the prompt is not part of the answer."""
    out.outputs = [CompletionOutput(index=c.index, text="", token_ids=[], cumulative_logprob=None,
                                    logprobs=[] if c.logprobs is not None else None, finish_reason="length",
                                    stop_reason=None) for c in out.outputs]
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
