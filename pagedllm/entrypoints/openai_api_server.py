"""`python -m pagedllm.entrypoints.openai_api_server --model MODEL [options]`: the same server
and options as `pagedllm serve MODEL`, for scripts written against vLLM's module entry point."""

from __future__ import annotations

import argparse
import sys

from pagedllm.entrypoints.cli import add_server_args, exit_on_signal_until_serving
from pagedllm.entrypoints.engine_cli import ArgumentParser, HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m pagedllm.entrypoints.openai_api_server",
        description="Serve --model over the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models) plus /health, /version and Prometheus /metrics. Without --model, the "
        "embedded SmolLM2-135M-Instruct is served.",
        formatter_class=HelpFormatter,
        usage="%(prog)s --model MODEL [options]",
    )
    return add_server_args(parser, positional_model=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    exit_on_signal_until_serving()
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(ns, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
