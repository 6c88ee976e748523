"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, run by uvicorn.

Owns the app (routes, error shapes, the guard middleware of guard.py for body size and API key), the
per-server Prometheus registry, and the process lifecycle: load the engine, serve, and on
SIGTERM / SIGINT stop accepting, give in-flight requests `--shutdown-timeout` seconds, abort
the rest (their streams end with finish_reason "abort"), and exit 0. If the engine loop dies,
/health answers 503 and the process exits with status 1 a moment later (a supervisor restarts it).

Every response that is not a success has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; user input never yields a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.fault_injection import StepFault
from pagedllm.entrypoints.openai.guard import GuardMiddleware, error_response
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_engine import parse_body, to_api_error
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization, add_tokenization_routes
from pagedllm.entrypoints.server_options import add_cors, api_keys, startup_lines, uvicorn_options

logger = logging.getLogger("pagedllm.entrypoints.openai.api_server")

STATS_LOG_INTERVAL_S = 5.0
# After the engine loop dies: how long /health keeps answering 503 (and the failed requests'
# errors go out) before the server shuts down, and how long that shutdown may wait for
# connections before it closes them.
DEAD_ENGINE_GRACE_S = 2.0
DEAD_ENGINE_SHUTDOWN_S = 3.0
EXIT_ENGINE_DEAD = 1


def build_app(
    engine: AsyncLLMEngine,
    *,
    served_model_names: list[str],
    model_path: str | None = None,
    max_model_len: int,
    vocab_size: int,
    api_key: str | list[str] | None = None,
    max_request_body_size: int = 8 << 20,
    chat_template: str | None = None,
    registry: Any = None,
    version: str = "0.1.0",
    enable_ui: bool = True,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The ASGI app over a started engine. `registry` is the Prometheus CollectorRegistry
    that /metrics exposes (None: /metrics is empty); `enable_ui` serves the engine page at /."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokenizer")
    common = dict(
        served_model_names=served_model_names, max_model_len=max_model_len, vocab_size=vocab_size, executor=executor
    )
    completion = OpenAIServingCompletion(engine, **common)
    chat = OpenAIServingChat(engine, chat_template=chat_template, enable_auto_tool_choice=enable_auto_tool_choice,
                             tool_call_parser=tool_call_parser, **common)
    tokenization = OpenAIServingTokenization(chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        yield
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedllm", version=version, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.engine = engine
    # The routes parse their bodies themselves (for OpenAI-shaped 400s); the schema still
    # describes those bodies, for clients and for schema-driven fuzzing.
    body_schemas: dict[str, Any] = {}
    completion_body = _request_body(CompletionRequest, body_schemas)
    chat_body = _request_body(ChatCompletionRequest, body_schemas)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(body_schemas)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    rejected = None
    if registry is not None:
        from pagedllm.entrypoints.openai.monitoring import register_monitoring

        rejected = register_monitoring(registry, engine, served_model_names[0])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if rejected is not None and exc.status_code == 503 and exc.code in ("queue_full", "engine_unavailable"):
            rejected.labels(model_name=served_model_names[0], reason=exc.code).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(f"invalid request: {exc.errors()}", 400))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(str(exc.detail), exc.status_code, code=code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(APIError("the engine loop has stopped", 503, code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def show_version() -> dict[str, str]:
        return {"version": version}

    @app.get("/metrics")
    async def metrics() -> Response:
        if registry is None:
            return Response(b"", media_type="text/plain")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [ModelCard(id=name, root=model_path, max_model_len=max_model_len) for name in served_model_names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        if model_id not in served_model_names:
            raise APIError(f"The model `{model_id}` does not exist.", 404, param="model", code="model_not_found")
        return ModelCard(id=model_id, root=model_path, max_model_len=max_model_len).model_dump()

    @app.post("/v1/completions", openapi_extra={"requestBody": completion_body})
    async def completions(raw_request: Request) -> Response:
        req = await parse_body(raw_request, CompletionRequest)
        return await completion.create_completion(req, raw_request)

    @app.post("/v1/chat/completions", openapi_extra={"requestBody": chat_body})
    async def chat_completions(raw_request: Request) -> Response:
        req = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.create_chat_completion(req, raw_request)

    if enable_ui:
        from pagedllm.entrypoints.openai.engine_page import register_engine_page

        register_engine_page(app, engine, [api_key] if isinstance(api_key, str) else list(api_key or []))
    add_tokenization_routes(app, tokenization)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_size=max_request_body_size)
    return app


def _request_body(model: Any, schemas: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI requestBody for `model`; its schema and those it refers to go into `schemas`
    (the document's components)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"required": True, "content": {"application/json": {"schema": ref}}}


# ---- process lifecycle ------------------------------------------------------------------------------


class _Interrupted(BaseException):
    """SIGTERM / SIGINT arrived while the engine was still loading (a BaseException, so that no
    `except Exception` in the loading code swallows it)."""


class _Server(uvicorn.Server):
    """uvicorn's server, plus: on the first exit signal, drain the engine (let in-flight requests
    finish for `shutdown_timeout` seconds, then abort them) so that open streams end cleanly
    and uvicorn's wait for connections ends; and a watchdog that shuts the server down (with
    `engine_died` set) when the engine loop dies."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.engine_died = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        watchdog = asyncio.ensure_future(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            if self._engine.errored:
                self.engine_died = True
                logger.error("the engine loop has died (%r); /health answers 503 and the server "
                             "exits in %.0f s", self._engine.dead_error, DEAD_ENGINE_GRACE_S)
                await asyncio.sleep(DEAD_ENGINE_GRACE_S)
                self.should_exit = True
                await asyncio.sleep(DEAD_ENGINE_SHUTDOWN_S)
                self.force_exit = True  # stop waiting for connections that do not close
                return
            await asyncio.sleep(0.1)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if not self._draining and self._loop is not None:
            self._draining = True
            logger.info("received %s: finishing in-flight requests (up to %.0f s)",
                        signal.Signals(sig).name, self._shutdown_timeout)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self._shutdown_timeout
        while self._engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._engine.num_in_flight:
            logger.info("aborting %d in-flight requests", self._engine.num_in_flight)
            self._engine.abort_all()


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    return value


def _step_fault_from_env() -> StepFault | None:
    """The test-only fault hook: $PAGEDLLM_TEST_FAULT (see StepFault), unset in production."""
    spec = os.environ.get(StepFault.ENV_VAR)
    if not spec:
        return None
    fault = StepFault.parse(spec)
    logger.warning("TEST FAULT INJECTION ENABLED (%s=%s)", StepFault.ENV_VAR, spec)
    return fault


def run_server(ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Load the engine, serve until SIGTERM / SIGINT, return the exit code."""
    from prometheus_client import CollectorRegistry

    from pagedllm.engine.metrics import LoggingStatLogger, PrometheusStatLogger
    from pagedllm.entrypoints.engine_cli import engine_args_from_namespace, package_version

    _setup_logging(ns.log_level)
    phase: dict[str, Any] = {"now": "loading", "server": None}

    def on_signal(signum: int, frame: Any) -> None:
        # uvicorn handles signals while it serves; this one sees them while loading (abort the
        # load), just before uvicorn installs its handlers, and when uvicorn re-raises them
        # after a graceful stop (then there is nothing left to do).
        if phase["now"] == "loading":
            raise _Interrupted()
        if phase["now"] == "serving" and phase["server"] is not None:
            phase["server"].handle_exit(signum, frame)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine: AsyncLLMEngine | None = None
    try:
        try:
            chat_template = _read_chat_template(ns.chat_template)
            step_fault = _step_fault_from_env()
            engine_args = engine_args_from_namespace(ns)
            engine = AsyncLLMEngine.from_engine_args(
                engine_args, max_queue_len=ns.max_queue_len, start=False, step_fault=step_fault
            )
        except ValueError as e:
            msg = f"error: {e}"
            if parser is not None:
                getattr(parser, "print_short_usage", parser.print_usage)(sys.stderr)
            print(f"{parser.prog if parser else 'pagedllm'}: {msg}", file=sys.stderr)
            return 2
        except _Interrupted:
            logger.info("interrupted while loading the model; exiting")
            return 0
        model_config = engine.model_config
        names = ns.served_model_name or [model_config.served_model_name]
        registry = CollectorRegistry()
        engine.stat_loggers.append(PrometheusStatLogger(names[0], registry, model_config.max_model_len))
        if not ns.disable_log_stats:
            engine.stat_loggers.append(LoggingStatLogger(STATS_LOG_INTERVAL_S))
        keys = api_keys(ns)
        server_kwargs = uvicorn_options(ns)
        engine.start()
        app = build_app(
            engine,
            served_model_names=names,
            model_path=model_config.model,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.vocab_size,
            api_key=keys,
            max_request_body_size=ns.max_request_body_size,
            chat_template=chat_template,
            registry=registry,
            version=package_version(),
            enable_ui=not getattr(ns, "disable_ui", False),
            enable_auto_tool_choice=getattr(ns, "enable_auto_tool_choice", False),
            tool_call_parser=getattr(ns, "tool_call_parser", None),
        )
        add_cors(app, ns)
        config = uvicorn.Config(
            app,
            **server_kwargs,
            host=ns.host,
            port=ns.port,
            log_config=None,
            log_level=getattr(ns, "uvicorn_log_level", ns.log_level),
            access_log=not ns.disable_uvicorn_access_log,
            timeout_keep_alive=5,
            # connections that never close (a TLS peer that skips close_notify) must not hold
            # the exit past the drain
            timeout_graceful_shutdown=ns.shutdown_timeout + 2,
        )
        server = _Server(config, engine, ns.shutdown_timeout)
        phase["server"] = server
        phase["now"] = "serving"
        for line in startup_lines(ns, names[0], model_config.model, len(keys)):
            logger.info("%s", line)
        asyncio.run(server.serve())
        phase["now"] = "done"
        if server.engine_died:
            logger.error("exiting with status %d: the engine loop died", EXIT_ENGINE_DEAD)
            return EXIT_ENGINE_DEAD
        return 0 if server.started else 1
    finally:
        phase["now"] = "done"
        if engine is not None:
            engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
