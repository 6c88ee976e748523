"""The way into the completion and chat endpoints, which they share: request bodies parsed and
errors mapped to OpenAI's, model-name checks, tokenization off the event loop, prompt
validation, SamplingParams from a request, logprob formatting, and admission to the engine. The
way out (SSE framing, merged streams, disconnects, text deltas) is streaming.py.

Every user mistake becomes an APIError with a 4xx status here, before the engine sees the
request; the engine's own checks are the second line, not the first.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
)
from pagedllm.entrypoints.json_body import JSONBodyError, parse_json_object
from pagedllm.entrypoints.openai.protocol import APIError, PromptTokenUsageInfo, UsageInfo
from pagedllm.entrypoints.openai.streaming import merge_async_iterators
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
_M = TypeVar("_M", bound=BaseModel)

# OpenAI's JSON has no -inf; vLLM clamps the same way.
_MIN_LOGPROB = -9999.0
_MAX_TOP_LOGPROBS = 20
_RETRY_AFTER_S = "1"
_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}
_FIELD_RE = re.compile(r"^([a-z_]+)\b")


def to_api_error(e: BaseException) -> APIError:
    """Map an engine-side exception to what the client should see."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(str(e), 503, type="server_error", code="queue_full",
                        headers={"Retry-After": _RETRY_AFTER_S})
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, type="server_error", code="engine_unavailable",
                        headers={"Retry-After": _RETRY_AFTER_S})
    if isinstance(e, RequestFailedError):
        return APIError(str(e), 500, type="server_error", code="engine_error")
    if isinstance(e, ValueError):  # the engine rejected the request's input
        m = _FIELD_RE.match(str(e))
        return APIError(str(e), 400, param=m.group(1) if m and m.group(1) in _SAMPLING_FIELDS else None)
    logger.exception("unexpected error", exc_info=e)
    return APIError(f"internal error: {e!r}", 500, type="server_error")


async def parse_body(raw_request: Any, model: type[_M]) -> _M:
    """The request body as `model`, or a 400 naming what is wrong with it."""
    body = await raw_request.body()
    try:
        data = parse_json_object(body)
    except JSONBodyError as e:
        raise APIError(str(e), code=e.code) from None
    bad = _first_invalid_string(body, data)
    if bad is not None:
        raise APIError(f"{bad or 'body'}: the string is not valid Unicode (a lone surrogate escape)", param=bad)
    unknown = [k for k in data if k not in model.model_fields and k not in NO_OP_FIELDS]
    if unknown:
        raise APIError(f"{unknown[0]}: pagedllm does not support this request field", param=unknown[0],
                       code="unsupported_field")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# Top-level request fields that change nothing we produce (bookkeeping for OpenAI's platform),
# accepted and ignored; any other field a route does not know is a 400 naming it, never dropped.
NO_OP_FIELDS = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


# A JSON escape of a UTF-16 surrogate, the only way a JSON text carries one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _first_invalid_string(body: bytes, data: Any) -> str | None:
    """The path ("messages.0.content") of the first string that is not valid Unicode: JSON lets
    a lone surrogate through as "\\ud800", and the tokenizer would fail on it later. Only a body
    that holds such an escape is walked."""
    if b"\\u" not in body or not _SURROGATE_ESCAPE.search(body):
        return None
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                # The path may hold the bad string itself (a key): escape it for the response.
                return ".".join(str(p) for p in path).encode("utf-8", "backslashreplace").decode()
        elif isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in reversed(list(value.items())))
            stack.extend(((*path, k), k) for k in value)
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))) if isinstance(v, (str, list, dict)))
    return None


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    parts, params = [], []
    for err in errors[:4]:
        # Union branches add their type to the location ("prompt.list[int].0"); keep the field path.
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
        name = ".".join(loc) or "body"
        params.append(name)
        parts.append(f"{name}: {err['msg']}")
    if len(errors) > 4:
        parts.append(f"... and {len(errors) - 4} more")
    return APIError("invalid request: " + "; ".join(parts), 400, param=params[0] if params else None)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        *,
        served_model_names: list[str],
        max_model_len: int,
        vocab_size: int,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.executor = executor

    # ---- checks -------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        """The name to report in responses; 404 for a model this server does not serve."""
        if name is None or name in self.served_model_names:
            return name or self.served_model_names[0]
        raise APIError(
            f"The model `{name}` does not exist. This server serves: {', '.join(self.served_model_names)}",
            404,
            param="model",
            code="model_not_found",
        )

    @property
    def max_logprobs(self) -> int:
        """--max-logprobs of the engine (-1: no cap)."""
        mc = getattr(self.engine, "model_config", None)
        return getattr(mc, "max_logprobs", _MAX_TOP_LOGPROBS)

    def check_logprobs(self, value: int | None, param: str) -> None:
        cap = self.max_logprobs
        if value is not None and (value < 0 or (cap != -1 and value > cap)):
            raise APIError(f"{param} must be in [0, {cap}] (--max-logprobs), got {value}", param=param)

    def truncate(self, ids: list[int], req: Any) -> list[int]:
        k = req.truncate_prompt_tokens
        if k is not None and k < 1:
            raise APIError(f"truncate_prompt_tokens must be >= 1, got {k}", param="truncate_prompt_tokens")
        return ids[-k:] if k is not None and len(ids) > k else ids

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        """With `prompt_tokens_details.cached_tokens` when the prefix cache served part of the prompt."""
        return UsageInfo(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens) if cached_tokens > 0 else None,
        )

    @staticmethod
    def check_common_unsupported(req: Any) -> None:
        if req.n < 1:
            raise APIError(f"n must be >= 1, got {req.n}", param="n")

    def validate_prompt_ids(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise APIError("the prompt is empty", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of vocabulary (size {self.vocab_size})", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(ids)} tokens, which leaves no room for the completion. Please "
                "reduce the length of the prompt.",
                param=param,
                code="context_length_exceeded",
            )

    def _model_defaults(self) -> dict[str, Any]:
        """SamplingParams defaults from the model's generation_config.json (generation_config="auto")."""
        return getattr(getattr(self.engine, "engine", None), "default_sampling_params", None) or {}

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        room = self.max_model_len - prompt_len
        if requested is None:  # the model's generation_config.json max_new_tokens, when it has one
            default = self._model_defaults().get("max_tokens")
            return min(room, default) if isinstance(default, int) and default > 0 else room
        if isinstance(requested, int) and requested < 1:
            raise APIError(f"{param} must be an integer >= 1, got {requested}", param=param)
        if isinstance(requested, int) and prompt_len + requested > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                "for the completion). Please reduce the length of the prompt or the completion.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self,
        req: Any, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
        structured_outputs: Any = None, skip_special_tokens: bool | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; a streamed request asks for DELTA outputs (its chunks
        are the deltas), any other for FINAL_ONLY (one output, nothing copied per step)."""
        # fields the request leaves unset take the model's generation_config.json defaults
        model_defaults = self._model_defaults()

        def either(value: Any, default: Any, name: str | None = None) -> Any:
            return model_defaults.get(name, default) if value is None else value

        try:
            return SamplingParams(
                n=req.n,
                temperature=either(req.temperature, 1.0, "temperature"),
                top_p=either(req.top_p, 1.0, "top_p"),
                top_k=either(req.top_k, 0, "top_k"),
                min_p=either(req.min_p, 0.0, "min_p"),
                presence_penalty=either(req.presence_penalty, 0.0),
                frequency_penalty=either(req.frequency_penalty, 0.0),
                repetition_penalty=either(req.repetition_penalty, 1.0, "repetition_penalty"),
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=either(skip_special_tokens, req.skip_special_tokens),
                include_stop_str_in_output=req.include_stop_str_in_output,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                structured_outputs=structured_outputs,
                output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as e:
            m = _FIELD_RE.match(str(e))
            raise APIError(str(e), param=m.group(1) if m else None) from None

    async def compile_grammar(self, so: Any, param: str) -> None:
        """Compiles (or finds in the cache) a request's grammar in the thread pool, so the
        engine's step loop only meets compiled grammars; a grammar that does not compile is a
        400 naming `param`."""
        engine = getattr(self.engine, "engine", None)
        if so is None or engine is None:
            return
        try:
            await self.run_in_executor(lambda: engine.structured_output_manager.compile(so))
        except ValueError as e:
            raise APIError(str(e).replace("structured_outputs", param, 1), param=param) from None

    # ---- tokenizer, off the event loop ------------------------------------------------------------

    async def run_in_executor(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run_in_executor(
            lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    async def detokenize(self, ids: list[int]) -> str:
        return await self.run_in_executor(lambda: self.tokenizer.decode(ids))

    # ---- logprobs -------------------------------------------------------------------------------

    def token_str(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    @staticmethod
    def clamp(logprob: float) -> float:
        return max(logprob, _MIN_LOGPROB)

    @staticmethod
    def top_entries(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        return sorted(step.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))[:k] if k else []

    # ---- engine admission -----------------------------------------------------------------------

    def submit(
        self, prompts: list[list[int]], params: list[SamplingParams], request_id: str, priority: int,
    ) -> AsyncIterator[tuple[int, Any]]:
        """Start one engine request per prompt; the merged stream yields (prompt index, output),
        of the kind each one's `output_kind` asks for."""
        try:
            self.engine.check_capacity(len(prompts))
        except (QueueFullError, EngineDeadError) as e:
            raise to_api_error(e) from None
        streams = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                streams.append(
                    self.engine.generate(ids, p, f"{request_id}-{i}", priority=priority)
                )
        except Exception as e:  # noqa: BLE001
            self.engine.abort_nowait([f"{request_id}-{j}" for j in range(len(streams))])
            raise to_api_error(e) from None
        return merge_async_iterators(streams)

    @staticmethod
    async def first_item(stream: AsyncIterator[T]) -> T:
        """The first output, so that an engine rejection is still a 4xx status, not an SSE
        error after a 200."""
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise APIError("the engine produced no output", 500, type="server_error") from None
        except Exception as e:  # noqa: BLE001
            await stream.aclose()  # type: ignore[attr-defined]
            raise to_api_error(e) from None
