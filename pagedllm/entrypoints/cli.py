"""The `pagedllm` command: `pagedllm serve [MODEL] [options]`.

Flags carry vLLM's spellings (plus the seed documents' aliases `--max-seq-length` and
`--cache-block-size`), so a `vllm serve` command line works with the binary name changed.
Parsing needs no torch, fastapi or model: `--help` is instant; the server modules are imported
only when `serve` runs.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.server_options import add_server_option_args
from pagedllm.entrypoints.engine_cli import (
    ArgumentParser,
    HelpFormatter,
    add_engine_args,
    engine_args_from_namespace,  # noqa: F401  (re-exported: callers and tests import it from here)
    non_negative_float,
    non_negative_int,
    package_version,
    port,
    size,
)

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_UVICORN_LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "trace")


def add_server_args(parser: argparse.ArgumentParser, *, positional_model: bool) -> argparse.ArgumentParser:
    """Every option of the OpenAI server; shared by `pagedllm serve` and
    `python -m pagedllm.entrypoints.openai_api_server`."""
    if positional_model:
        parser.add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL",
            help="Model to serve: a Hugging Face directory or a .gguf file. Without one, the "
            "embedded SmolLM2-135M-Instruct is served.",
        )
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="Model to serve: a Hugging Face directory, a .gguf file or a hub id (org/name; a GGUF "
                   "repo as org/name:FILE.gguf). Default: the embedded SmolLM2-135M-Instruct.")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Name(s) clients use in the `model` field; the first is the one responses report. "
                   "Default: the hub id, or the model's directory or file name.")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file path or the template text) that replaces the tokenizer's.")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                   help='Let tool_choice "auto" work: the --tool-call-parser finds the calls the model wrote.')
    g.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="How the model writes tool calls: hermes (Qwen2.5/Qwen3, SmolLM, Hermes), llama3_json, mistral.")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    g.add_argument("--port", type=port, default=8000, help="Port to listen on.")
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="Require `Authorization: Bearer KEY` on every /v1 route; several keys may be given. "
                   "Default: $PAGEDLLM_API_KEY, else $VLLM_API_KEY, else none.")
    g.add_argument("--max-queue-len", type=non_negative_int, default=None,
                   help="Requests that may wait beyond the --max-num-seqs being served; more get "
                   "503 with Retry-After. Default: no limit.")
    g.add_argument("--max-request-body-size", type=size, default=8 << 20,
                   help="Largest request body, e.g. 8MiB; larger bodies get 413.")
    g.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                   help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them.")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every HTTP request.")
    g.add_argument("--log-level", default="info", choices=_LOG_LEVELS, help="Logging level.")
    g.add_argument("--uvicorn-log-level", default="info", choices=_UVICORN_LOG_LEVELS,
                   help="Logging level of uvicorn (the HTTP server).")
    g.add_argument("--disable-ui", action="store_true",
                   help="Do not serve the engine page (chat playground and live engine view) at /.")
    add_server_option_args(g)
    add_engine_args(parser, EngineArgs)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pagedllm", description="pagedllm: a fast LLM inference and serving engine (paged KV cache)."
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models) plus /health, /version and Prometheus /metrics.",
        formatter_class=HelpFormatter,
        usage="pagedllm serve [MODEL] [options]",
    )
    add_server_args(serve, positional_model=True)
    from pagedllm.planner_cli import add_plan_args

    plan = sub.add_parser(
        "plan",
        help="Memory plan for a model before loading it: weights, activations, KV cache, concurrency.",
        description="Weights per rank, KV bytes per token, activations and the KV cache a GPU (or this CPU) "
        "holds for MODEL, the max concurrency at --max-model-len, what TP, FP8 or a shorter context would "
        "buy, and the smallest change that fits. Reads only the model's config. Exit 1 when it does not fit.",
        formatter_class=HelpFormatter,
    )
    add_plan_args(plan)
    from pagedllm.router.cli import add_router_args

    router = sub.add_parser("router", help="Route OpenAI requests over tiers of servers (pagedllm/router).",
                            description="An OpenAI-compatible gateway over tiers of backends (docs/router.md).")
    add_router_args(router)
    return parser


def exit_on_signal_until_serving() -> None:
    """SIGTERM / SIGINT before the server has installed its own handlers (while the heavy modules
    import) end the process with 0, like a stop at any later moment."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "plan":
        from pagedllm.planner_cli import run_plan

        return run_plan(ns)
    if ns.command == "router":
        from pagedllm.router.cli import run_router

        return run_router(ns, parser=parser)
    if ns.command != "serve":
        parser.print_help()
        return 2
    exit_on_signal_until_serving()
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(ns, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
