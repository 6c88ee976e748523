"""The `pagedllm` command: `pagedllm serve [MODEL] [options]`.

Flags carry vLLM's spellings (plus the seed documents' aliases `--max-seq-length` and
`--cache-block-size`), so a `vllm serve` command line works with the binary name changed.
Parsing needs no torch, fastapi or model: `--help` is instant; the server modules are imported
only when `serve` runs.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pagedllm.config import (
    LOAD_FORMATS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    EngineArgs,
    parse_size,
)

_DEFAULTS = EngineArgs()
_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_HUMAN_INT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*$")
# As vLLM: a lowercase suffix is decimal (4k = 4000), an uppercase one binary (4K = 4096).
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _human_int(value: str) -> int:
    """An integer, also written with a suffix: 4k = 4000, 4K = 4096, 1m = 10**6, 1M = 2**20."""
    m = _HUMAN_INT.match(value)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 4k or 4K, got {value!r}")
    number = float(m.group(1)) * _MULTIPLIERS[m.group(2)]
    if number != int(number):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}")
    return int(number)


def _positive_int(value: str) -> int:
    n = _human_int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return n


def _non_negative_int(value: str) -> int:
    n = _human_int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return n


def _port(value: str) -> int:
    n = _human_int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value!r}")
    return n


def _non_negative_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return x


def _fraction(value: str) -> float:
    x = _non_negative_float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}")
    return x


def _size(value: str) -> int:
    try:
        n = parse_size(value, "size")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MiB or 1073741824, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value!r}")
    return n


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it says something (not None / False) and the help text does
    not already explain it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "Default" in text:
            return text
        return super()._get_help_string(action)


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
                   help="Model to serve: a Hugging Face directory or a .gguf file (the embedded "
                   "SmolLM2-135M-Instruct when no model is given).")
    g.add_argument("--tokenizer", default=None, help="Tokenizer directory, when it differs from the model's.")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Name(s) clients use in the `model` field; the first is the one responses report. "
                   "Default: the model's directory or file name.")
    g.add_argument("--dtype", default=_DEFAULTS.dtype, choices=_DTYPES,
                   help="Weight and activation dtype. auto: float32 on CPU, the model's half type on GPU.")
    g.add_argument("--load-format", default=_DEFAULTS.load_format, choices=LOAD_FORMATS,
                   help="How to load weights; dummy makes random weights (for benchmarks).")
    g.add_argument("--max-model-len", "--max-seq-length", dest="max_model_len", type=_positive_int, default=None,
                   help="Longest sequence (prompt + completion) in tokens, e.g. 4096 or 4K (= 4096). "
                   "Default: the model's max_position_embeddings.")
    g.add_argument("--seed", type=_non_negative_int, default=_DEFAULTS.seed, help="Random seed of the engine.")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file path or the template text) that replaces the tokenizer's.")

    g = parser.add_argument_group("cache and scheduler")
    g.add_argument("--device", default=_DEFAULTS.device, choices=DEVICES, help="Where to run; auto picks cuda when present.")
    g.add_argument("--block-size", "--cache-block-size", dest="block_size", type=_positive_int,
                   default=_DEFAULTS.block_size, help="Tokens per KV-cache block (a power of two).")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=_DEFAULTS.gpu_memory_utilization,
                   help="Fraction of GPU memory the engine may use (weights, activations and KV cache), in (0, 1].")
    g.add_argument("--kv-cache-memory", type=_size, default=None,
                   help="KV-cache size, e.g. 2GiB; overrides --gpu-memory-utilization. On CPU the default is a modest fixed size.")
    g.add_argument("--swap-space", type=_non_negative_float, default=_DEFAULTS.swap_space,
                   help="GiB of CPU memory for KV blocks of swapped-out requests (with --preemption-mode swap).")
    g.add_argument("--max-num-seqs", type=_positive_int, default=_DEFAULTS.max_num_seqs,
                   help="Most requests (sequences) in one batch.")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="Token budget of one step (prefill chunks plus decodes). Default: 2048 on CPU, 8192 on GPU.")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.enable_prefix_caching,
                   help="Reuse KV blocks of shared prompt prefixes across requests.")
    g.add_argument("--preemption-mode", default=_DEFAULTS.preemption_mode, choices=PREEMPTION_MODES,
                   help="When KV blocks run out: recompute (free and re-run the prompt later) or swap (to CPU memory).")
    g.add_argument("--scheduling-policy", default=_DEFAULTS.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="fcfs: first come first served; priority: lower `priority` field first.")
    g.add_argument("--batch-wait-timeout", type=_non_negative_float, default=_DEFAULTS.batch_wait_timeout,
                   help="Milliseconds the scheduler may wait for more requests to fill a batch.")
    g.add_argument("--enforce-eager", action="store_true", help="Never capture CUDA graphs.")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=_DEFAULTS.tensor_parallel_size,
                   help="Number of GPUs to split the model across.")
    g.add_argument("--distributed-executor-backend", default=None, choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                   help="How the tensor-parallel ranks run: mp (a process per rank on this machine; the "
                   "default when --tensor-parallel-size > 1), ray (a Ray actor per rank, on the cluster "
                   "of $RAY_ADDRESS or a local one) or uni (one worker in the server's process).")

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for every interface).")
    g.add_argument("--port", type=_port, default=8000, help="Port to listen on.")
    g.add_argument("--api-key", default=None,
                   help="Require `Authorization: Bearer KEY` on every /v1 route; $PAGEDLLM_API_KEY when not given.")
    g.add_argument("--max-queue-len", type=_non_negative_int, default=None,
                   help="Requests that may wait beyond the --max-num-seqs being served; more get "
                   "503 with Retry-After. Default: no limit.")
    g.add_argument("--max-request-body-size", type=_size, default=8 << 20,
                   help="Largest request body, e.g. 8MiB; larger bodies get 413.")
    g.add_argument("--shutdown-timeout", type=_non_negative_float, default=10.0,
                   help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them.")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="Do not log the throughput / queue / KV-usage line every few seconds.")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every HTTP request.")
    g.add_argument("--log-level", default="info", choices=_LOG_LEVELS, help="Logging level.")
    return parser


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    model = getattr(ns, "model_tag", None)
    if model is not None and ns.model is not None and model != ns.model:
        raise ValueError(f"two models given: {model!r} and --model {ns.model!r}")
    model = model or ns.model
    names = ns.served_model_name
    return EngineArgs(
        model=model,
        tokenizer=ns.tokenizer,
        served_model_name=names[0] if names else None,
        dtype=ns.dtype,
        max_model_len=ns.max_model_len,
        block_size=ns.block_size,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory=ns.kv_cache_memory,
        swap_space=ns.swap_space,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=ns.enable_prefix_caching,
        enforce_eager=ns.enforce_eager,
        seed=ns.seed,
        load_format=ns.load_format,
        preemption_mode=ns.preemption_mode,
        scheduling_policy=ns.scheduling_policy,
        batch_wait_timeout=ns.batch_wait_timeout,
        tensor_parallel_size=ns.tensor_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
        device=ns.device,
        disable_log_stats=ns.disable_log_stats,
    )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0.1.0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="pagedllm: a fast LLM inference and serving engine (paged KV cache)."
    )
    parser.add_argument("--version", action="version", version=f"pagedllm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="Serve a model over an OpenAI-compatible HTTP API.",
        description="Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, "
        "/v1/models) plus /health, /version and Prometheus /metrics.",
        formatter_class=_HelpFormatter,
    )
    add_server_args(serve, positional_model=True)
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
    if ns.command != "serve":
        parser.print_help()
        return 2
    exit_on_signal_until_serving()
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(ns, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
