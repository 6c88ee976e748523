"""The way out of the completion and chat endpoints: the engine's outputs to the client. SSE
framing (errors as OpenAI error bodies, the plainest chunk cut from a pre-rendered template),
several requests' streams merged into one, a request cancelled when its client goes away, and a
choice's text released as deltas that never split a UTF-8 character. The way in (request
checks, SamplingParams, submission) is serving_engine.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import pydantic_core
from pydantic import BaseModel

from pagedllm.entrypoints.openai.protocol import APIError, ErrorInfo, ErrorResponse

T = TypeVar("T")


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def sse_error(err: APIError) -> str:
    """The error frame of a stream that fails after its 200 (serving_engine.to_api_error's)."""
    body = ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code))
    return sse(body)


SSE_DONE = "data: [DONE]\n\n"

# what a template chunk holds where a real one has its choice index and text
_TEMPLATE_INDEX = 918273645
_TEMPLATE_TEXT = "\x01pagedllm template text\x01"


class TextChunks:
    """The SSE frame of a response's plainest chunk (a choice index and its new text; no
    logprobs, finish reason, tool calls or usage), the commonest one in a stream: cut from a
    frame that pydantic wrote for the response once, with the text encoded by pydantic's own
    JSON serializer, so the bytes are those of `sse(model)` at a fifth of its cost per chunk.
    `make(index, text)` -> the chunk model with those placeholders; `frame` is None (use the
    models) if the placeholders cannot be found exactly once."""

    __slots__ = ("_parts",)

    def __init__(self, make: Any) -> None:
        raw = sse(make(_TEMPLATE_INDEX, _TEMPLATE_TEXT))
        text = pydantic_core.to_json(_TEMPLATE_TEXT).decode()
        idx = str(_TEMPLATE_INDEX)
        self._parts: tuple[str, str, str] | None = None
        if raw.count(idx) == 1 and raw.count(text) == 1 and raw.index(idx) < raw.index(text):
            head, rest = raw.split(idx)
            mid, tail = rest.split(text)
            self._parts = (head, mid, tail)

    def frame(self, index: int, text: str) -> str | None:
        if self._parts is None:
            return None
        head, mid, tail = self._parts
        return f"{head}{index}{mid}{pydantic_core.to_json(text).decode()}{tail}"


async def _next(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield (index of the iterator, item) as items arrive from any of them. Closing the merged
    iterator closes every source (which aborts their requests)."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await iterators[0].aclose()  # type: ignore[attr-defined]
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(_next(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(_next(iterators[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()  # type: ignore[attr-defined]


async def _wait_for_disconnect(raw_request: Any) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


async def cancel_on_disconnect(coro: Awaitable[T], raw_request: Any) -> T:
    """Run `coro`; if the client disconnects first, cancel it (its requests are aborted) and
    raise ClientDisconnected."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone anyway
        pass
    raise ClientDisconnected()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


class TextDeltas:
    """A streamed choice's text from the engine's deltas: what can go out now, holding back a
    trailing partial UTF-8 character (U+FFFD) until more text or the end comes. (The engine's
    text already holds back what could begin a stop string.) `sent` counts what went out."""

    __slots__ = ("held", "sent")

    def __init__(self) -> None:
        self.held = ""
        self.sent = 0

    def take(self, text: str, finished: bool) -> str:
        if self.held:
            text = self.held + text
        end = len(text)
        if not finished:
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
        if end == len(text):
            self.held = ""
        else:
            text, self.held = text[:end], text[end:]
        self.sent += len(text)
        return text
