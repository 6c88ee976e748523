"""`pagedllm serve` and `python -m pagedllm.entrypoints.openai_api_server`: every flag of the
issue parses (with vLLM's spellings and the seed documents' aliases) into EngineArgs, `--help`
explains each, and bad values are usage errors."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pagedllm.entrypoints import openai_api_server
from pagedllm.entrypoints.cli import build_parser, engine_args_from_namespace

ISSUE_FLAGS = [
    "--host", "--port", "--served-model-name", "--api-key", "--dtype", "--gpu-memory-utilization",
    "--kv-cache-memory", "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len", "--max-seq-length",
    "--block-size", "--cache-block-size", "--swap-space", "--preemption-mode", "--scheduling-policy",
    "--batch-wait-timeout", "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager", "--seed",
    "--tensor-parallel-size", "--max-queue-len", "--disable-log-stats", "--log-level", "--max-request-body-size",
]


def serve(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_defaults():
    ns = serve()
    assert ns.host == "127.0.0.1" and ns.port == 8000
    args = engine_args_from_namespace(ns)
    assert args.model is None  # the embedded SmolLM2
    assert args.block_size == 16 and args.enable_prefix_caching is True and args.disable_log_stats is False


def test_every_flag_maps_to_engine_args():
    ns = serve(
        "/m", "--served-model-name", "a", "b", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5",
        "--kv-cache-memory", "2GiB", "--max-num-batched-tokens", "4096", "--max-num-seqs", "32",
        "--max-seq-length", "2K", "--cache-block-size", "32", "--swap-space", "2", "--preemption-mode", "swap",
        "--scheduling-policy", "priority", "--batch-wait-timeout", "5", "--no-enable-prefix-caching",
        "--enforce-eager", "--seed", "3", "-tp", "1", "--max-queue-len", "10", "--disable-log-stats",
        "--log-level", "debug", "--api-key", "k", "--port", "9000", "--host", "0.0.0.0",
    )
    args = engine_args_from_namespace(ns)
    assert args.model == "/m" and args.served_model_name == "a" and ns.served_model_name == ["a", "b"]
    assert (args.dtype, args.gpu_memory_utilization, args.kv_cache_memory) == ("bfloat16", 0.5, 2 << 30)
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len) == (4096, 32, 2048)
    assert (args.block_size, args.swap_space, args.preemption_mode) == (32, 2.0, "swap")
    assert (args.scheduling_policy, args.batch_wait_timeout) == ("priority", 5.0)
    assert args.enable_prefix_caching is False and args.enforce_eager is True and args.seed == 3
    assert args.tensor_parallel_size == 1 and args.disable_log_stats is True
    assert (ns.max_queue_len, ns.log_level, ns.api_key, ns.port, ns.host) == (10, "debug", ["k"], 9000, "0.0.0.0")


def test_vllm_spellings_equal_aliases():
    a = engine_args_from_namespace(serve("--max-model-len", "1000", "--block-size", "8"))
    b = engine_args_from_namespace(serve("--max-seq-length", "1k", "--cache-block-size", "8"))
    assert (a.max_model_len, a.block_size) == (b.max_model_len, b.block_size) == (1000, 8)


def test_module_entry_point_takes_the_same_options():
    ns = openai_api_server.build_parser().parse_args(["--model", "/m", "--max-seq-length", "64", "--port", "1"])
    args = engine_args_from_namespace(ns)
    assert (args.model, args.max_model_len, ns.port) == ("/m", 64, 1)


def test_two_different_models_is_an_error():
    with pytest.raises(ValueError):
        engine_args_from_namespace(serve("/a", "--model", "/b"))


@pytest.mark.parametrize("argv", [
    ["--port", "70000"], ["--max-num-seqs", "0"], ["--gpu-memory-utilization", "1.5"], ["--dtype", "int3"],
    ["--kv-cache-memory", "lots"], ["--swap-space", "-1"], ["--preemption-mode", "pray"], ["--max-queue-len", "-1"],
    ["--max-model-len", "1.5"], ["--log-level", "chatty"],
])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        serve(*argv)
    assert e.value.code == 2


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ISSUE_FLAGS:
        assert flag in out.stdout, flag
    module_help = openai_api_server.build_parser().format_help()
    for flag in ISSUE_FLAGS:
        assert flag in module_help, flag
    # every option has a sentence of help
    for action in build_parser()._subparsers._group_actions[0].choices["serve"]._actions:
        assert action.help, action.option_strings


def test_cli_imports_no_server_or_torch():
    code = ("import sys, pagedllm, pagedllm.entrypoints.cli, pagedllm.engine.async_engine, pagedllm.engine.metrics; "
            "bad = [m for m in ('torch', 'fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
