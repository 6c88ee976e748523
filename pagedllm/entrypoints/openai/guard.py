"""What every HTTP request passes before a route: the guard middleware of the OpenAI server
(request bodies over the size limit get 413, /v1 requests without a configured API key 401),
and the one shape every error response takes (OpenAI's `{"error": {...}}`)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import APIError


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


class GuardMiddleware:
    """Pure ASGI (so streaming is untouched): before any route runs, reject bodies larger than
    `max_body_size` (413) and, when an API key is set, /v1 requests without it (401)."""

    def __init__(self, app: Any, *, api_key: str | list[str] | None, max_body_size: int) -> None:
        self.app = app
        # Only the key's digest is kept; comparing digests takes the same time whatever the
        # length or content of the key that was sent.
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_keys = [hashlib.sha256(k.encode()).digest() for k in keys if k]
        self.api_key = self.api_keys or None
        self.max_body_size = max_body_size

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path: str = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # behind --root-path the path still carries the prefix
            path = path[len(root):]
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS":
            if not self._authorized(headers.get(b"authorization", b"")):
                await self._reject(scope, receive, send, APIError(
                    "Incorrect or missing API key; send it as 'Authorization: Bearer KEY'.",
                    401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
                ))
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                await self._reject(scope, receive, send, APIError("invalid Content-Length header"))
                return
            if size > self.max_body_size:
                await self._reject(scope, receive, send, self._too_large(size))
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # No Content-Length (chunked): read up to the limit here, then replay it to the app.
            chunks, total = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body = message.get("body", b"")
                total += len(body)
                if total > self.max_body_size:
                    await self._reject(scope, receive, send, self._too_large(total))
                    return
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, key = header.partition(b" ")
        key = key.strip() if scheme.lower() == b"bearer" else b""
        # Constant time: equal-length digests, compared without an early exit.
        digest = hashlib.sha256(key).digest()
        # every key is compared (no early exit), so the time says nothing about which matched
        matched = [hmac.compare_digest(digest, k) for k in self.api_keys]
        return any(matched) and bool(key)

    def _too_large(self, size: int) -> APIError:
        return APIError(
            f"request body of {size} bytes exceeds the limit of {self.max_body_size} bytes",
            413, code="request_too_large",
        )

    @staticmethod
    async def _reject(scope: dict, receive: Any, send: Any, err: APIError) -> None:
        await error_response(err)(scope, receive, send)
