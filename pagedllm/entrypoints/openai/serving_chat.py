"""POST /v1/chat/completions: the messages go through the model's chat template (or the one
given with --chat-template), the result is tokenized without adding special tokens again (the
template has them), and one engine request with `n` samples serves it.

Streaming: each choice's first chunk carries `delta.role = "assistant"`, later ones the new
content, the last one `finish_reason`; then usage if asked, then [DONE].

Tools: `tools` go to the chat template; "required" and named `tool_choice` constrain the output
with a JSON-schema grammar; "auto" needs --enable-auto-tool-choice and a --tool-call-parser,
which finds the calls the model wrote. Earlier assistant `tool_calls` and `tool` messages are
rendered through the template (as hermes-style text when the template has no place for them).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatMessage,
    ChatResponseMessage,
    ChatTopLogprob,
    DeltaMessage,
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
from pagedllm.entrypoints.openai.structured_outputs import (
    check_tools,
    forced_tool_schema,
    normalize_tool_choice,
    request_structured_outputs,
)
from pagedllm.entrypoints.openai.tool_calls import ToolCallStreamer, final_tool_calls, tool_mode
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.structured_output.params import StructuredOutputsParams

# OpenAI's message roles.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Arguments of apply_chat_template that the server sets itself; chat_template_kwargs may not
# replace them (a request never picks the template, nor turns rendering into tokenizing).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding",
    "truncation", "max_length",
})


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, chat_template: str | None = None, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser: ToolParser | None = (
            get_tool_parser(tool_call_parser)(self.tokenizer) if tool_call_parser else None
        )
        source = chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        self.template_renders_tool_calls = isinstance(source, str) and "tool_calls" in source

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Any) -> Response:
        model_name = self.check_model(req.model)
        self.check_common_unsupported(req)
        if not req.messages:
            raise APIError("messages must not be empty", param="messages")
        if req.top_logprobs is not None:
            self.check_logprobs(req.top_logprobs, "top_logprobs")
            if not req.logprobs and req.top_logprobs > 0:
                raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        if req.prompt_logprobs is not None:
            raise APIError("prompt_logprobs is only supported on /v1/completions", param="prompt_logprobs")
        so = request_structured_outputs(req)
        tools = check_tools(req.tools)
        choice = normalize_tool_choice(req.tool_choice, tools)
        if choice == "auto" and tools and (not self.enable_auto_tool_choice or self.tool_parser is None):
            raise APIError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                           "--tool-call-parser", param="tool_choice")
        if choice == "required" or choice.startswith("function:"):
            if so is not None:
                raise APIError(f"tool_choice={req.tool_choice!r} and a structured output cannot be combined",
                               param="tool_choice")
            so = StructuredOutputsParams(json=forced_tool_schema(choice, tools, req.parallel_tool_calls is not False))
        mode = tool_mode(choice, self.tool_parser) if tools else None
        await self.compile_grammar(so, "response_format" if req.response_format else "structured_outputs")

        conversation = [self._message(m, i) for i, m in enumerate(req.messages)]
        prompt = await self.run_in_executor(self._render, conversation, req, choice)
        ids = self.truncate(await self.tokenize(prompt, add_special_tokens=False), req)
        self.validate_prompt_ids(ids, param="messages")
        if req.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(req.max_completion_tokens, len(ids), "max_completion_tokens")
        else:
            max_tokens = self.resolve_max_tokens(req.max_tokens, len(ids), "max_tokens")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        keep_special = mode == "auto" and self.tool_parser.keep_special_tokens
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=num_top, structured_outputs=so,
                                      skip_special_tokens=False if keep_special else None)

        request_id = random_id("chatcmpl")
        created = int(time.time())
        stream = self.submit([ids], [params], request_id, req.priority)
        if req.stream:
            try:  # the first token may be a long prefill away: watch the client meanwhile
                first = await cancel_on_disconnect(self.first_item(stream), raw_request)
            except ClientDisconnected:
                return Response(status_code=499)
            body = self._stream(req, request_id, created, model_name, prepend(first, stream), len(ids), mode, choice)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            finals = await cancel_on_disconnect(self._collect(stream), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - engine failures become OpenAI errors
            raise to_api_error(e) from None
        return JSONResponse(self._response(req, request_id, created, model_name, finals, mode, choice).model_dump())

    @staticmethod
    def _message(m: ChatMessage, idx: int) -> dict[str, Any]:
        if m.role not in _ROLES:
            raise APIError(
                f"messages[{idx}].role must be one of {', '.join(sorted(_ROLES))}; got {m.role!r}",
                param=f"messages.{idx}.role",
            )
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{idx}].content: only text parts are supported, got {part.get('type')!r}",
                        param=f"messages.{idx}.content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [_history_tool_call(c, idx, j) for j, c in enumerate(m.tool_calls)]
        return msg

    def _render(self, conversation: list[dict[str, Any]], req: ChatCompletionRequest, choice: str = "none") -> str:
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model has no chat template; start the server with --chat-template", param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        if not self.template_renders_tool_calls:
            # a template without tool calls would drop them: they become hermes-style text
            conversation = [_inline_tool_calls(m) for m in conversation]
        tools = getattr(req, "tools", None)
        if tools and choice != "none":
            kwargs["tools"] = tools
        try:
            out = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **kwargs,
            )
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors come from the user's messages
            raise APIError(f"the chat template could not render these messages: {e}", param="messages") from None
        if not isinstance(out, str):
            raise APIError("the chat template did not produce text", 500, type="server_error")
        return out

    @staticmethod
    async def _collect(stream: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
        final = None
        async for _, out in stream:
            final = out
        assert final is not None
        return final

    # ---- logprobs ---------------------------------------------------------------------------------

    def _logprobs(
        self, token_ids: list[int], steps: list[dict[int, Logprob]] | None, num_top: int
    ) -> ChatCompletionLogProbs:
        content = []
        for pos, tid in enumerate(token_ids):
            step = steps[pos] if steps is not None and pos < len(steps) else None
            lp = step.get(tid) if step else None
            token = self.token_str(tid, lp)
            top = [
                ChatTopLogprob(token=(s := self.token_str(t, l)), logprob=self.clamp(l.logprob), bytes=list(s.encode()))
                for t, l in self.top_entries(step or {}, num_top)
            ]
            content.append(
                ChatLogprobEntry(
                    token=token,
                    logprob=self.clamp(lp.logprob) if lp is not None else -9999.0,
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)

    # ---- non-streaming ----------------------------------------------------------------------------

    def _response(
        self, req: ChatCompletionRequest, request_id: str, created: int, model_name: str, final: RequestOutput,
        mode: str | None = None, choice: str = "none",
    ) -> ChatCompletionResponse:
        num_top = req.top_logprobs or 0
        choices = []
        for c in final.outputs:
            message = ChatResponseMessage(role="assistant", content=c.text)
            finish = c.finish_reason
            if mode is not None:
                message.content, message.tool_calls = final_tool_calls(mode, choice, self.tool_parser, c.text)
                if message.tool_calls and finish == "stop":
                    finish = "tool_calls"
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(c.token_ids, c.logprobs, num_top) if req.logprobs else None,
                    finish_reason=finish,
                    stop_reason=c.stop_reason,
                )
            )
        prompt_tokens = len(final.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = self.usage(prompt_tokens, completion_tokens, final.num_cached_tokens)
        return ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage)

    # ---- streaming --------------------------------------------------------------------------------

    async def _stream(
        self,
        req: ChatCompletionRequest,
        request_id: str,
        created: int,
        model_name: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        num_prompt_tokens: int,
        mode: str | None = None,
        choice: str = "none",
    ) -> AsyncIterator[str]:
        n = req.n
        streamers = [ToolCallStreamer(mode, choice, self.tool_parser) if mode else None for _ in range(n)]
        any_calls = [False] * n
        num_top = req.top_logprobs or 0
        texts = [TextDeltas() for _ in range(n)]
        num_tokens = [0] * n  # generated so far, per choice
        finished = [False] * n
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous_usage = include_usage and bool(opts and opts.continuous_usage_stats)

        def chunk(choice: ChatCompletionStreamChoice | None, usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model_name,
                    choices=[choice] if choice is not None else [], usage=usage,
                )
            )

        plain = TextChunks(lambda i, text: ChatCompletionStreamResponse(
            id=request_id, created=created, model=model_name,
            choices=[ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text))]))

        num_cached = 0
        try:
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            # each output holds only what is new (DELTA), of the samples that have something new
            async for _, out in outputs:
                num_cached = out.num_cached_tokens
                for c in out.outputs:
                    num_tokens[c.index] += len(c.token_ids)
                for c in out.outputs:
                    i = c.index
                    if finished[i]:
                        continue
                    done = c.finish_reason is not None
                    delta = texts[i].take(c.text, done)
                    new_ids = c.token_ids
                    if not delta and not done and not (new_ids and req.logprobs):
                        continue
                    logprobs = self._logprobs(new_ids, c.logprobs, num_top) if req.logprobs else None
                    finished[i] = done
                    streamer = streamers[i]
                    if not done and logprobs is None and streamer is None and not continuous_usage:
                        frame = plain.frame(i, delta)
                        if frame is not None:
                            yield frame
                            continue
                    message = DeltaMessage(content=delta)
                    finish = c.finish_reason
                    if streamer is not None:
                        content, calls = streamer.update(delta, done)
                        message = DeltaMessage(content=content if content or not calls else None,
                                               tool_calls=calls or None)
                        any_calls[i] = any_calls[i] or bool(calls)
                        if any_calls[i] and finish == "stop":
                            finish = "tool_calls"
                        if not content and not calls and not done and not logprobs:
                            continue
                    usage = None
                    if continuous_usage:
                        usage = self.usage(num_prompt_tokens, sum(num_tokens), num_cached)
                    yield chunk(
                        ChatCompletionStreamChoice(
                            index=i,
                            delta=message,
                            logprobs=logprobs,
                            finish_reason=finish,
                            stop_reason=c.stop_reason,
                        ),
                        usage,
                    )
            if include_usage:
                yield chunk(None, self.usage(num_prompt_tokens, sum(num_tokens), num_cached))
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in the stream
            yield sse_error(to_api_error(e))
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE


def _history_tool_call(call: dict[str, Any], msg_idx: int, j: int) -> dict[str, Any]:
    """An assistant's earlier tool call for the template: arguments as an object (templates
    write them with `tojson`)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"messages[{msg_idx}].tool_calls[{j}] must have function.name",
                       param=f"messages.{msg_idx}.tool_calls.{j}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(f"messages[{msg_idx}].tool_calls[{j}].function.arguments is not JSON",
                           param=f"messages.{msg_idx}.tool_calls.{j}") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _inline_tool_calls(msg: dict[str, Any]) -> dict[str, Any]:
    if not msg.get("tool_calls"):
        return msg
    calls = "".join(
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>" for c in msg["tool_calls"]
    )
    text = msg.get("content") or ""
    out = {k: v for k, v in msg.items() if k != "tool_calls"}
    out["content"] = (text + "\n" if text else "") + calls
    return out
