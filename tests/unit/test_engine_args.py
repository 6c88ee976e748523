"""vLLM's engine arguments: every EngineArgs field has its flag, the arguments a vLLM user
passes are honoured or accepted with one log line, arguments other issues deliver are clear
errors, typos fail loudly, sizes parse, and a block size the kernels cannot use is mapped."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.arg_utils import ACCEPTED
from pagedllm.engine.vllm_compat import parse_size
from pagedllm.entrypoints.cli import build_parser, engine_args_from_namespace

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 7]


def serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="8MiB", max_model_len=128)
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_every_field_has_a_flag():
    parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in parser._actions}
    flags = set(parser._option_string_actions)
    for f in dataclasses.fields(EngineArgs):
        if f.metadata.get("alias_of"):
            assert "--" + f.name.replace("_", "-") in flags, f.name
        elif f.metadata.get("cli", True):
            assert f.name in dests, f.name
        assert f.metadata.get("help"), f.name


def test_flags_reach_engine_args():
    args = engine_args_from_namespace(serve(
        "m", "--trust-remote-code", "--revision", "v1", "--tokenizer-revision", "t1", "--download-dir", "/d",
        "--hf-token", "--gguf-file", "x.gguf", "--hf-overrides", '{"rope_theta": 5.0}',
        "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}',
        "--max-logprobs", "7", "--no-enable-chunked-prefill", "--kv-cache-memory-bytes", "1G",
        "--async-scheduling", "--attention-backend", "FLASH_ATTN", "--max-num-partial-prefills", "2",
        "--disable-log-requests", "--swap-space", "10G", "--cache-block-size", "4096",
    ))
    assert (args.trust_remote_code, args.revision, args.tokenizer_revision, args.download_dir) == (True, "v1", "t1", "/d")
    assert args.hf_token is True and args.gguf_file == "x.gguf" and args.hf_overrides == {"rope_theta": 5.0}
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"temperature": 0.5})
    assert (args.max_logprobs, args.enable_chunked_prefill, args.kv_cache_memory) == (7, False, 1 << 30)
    assert (args.async_scheduling, args.attention_backend, args.max_num_partial_prefills) == (True, "FLASH_ATTN", 2)
    assert args.disable_log_requests is True and args.swap_space == 10.0 and args.block_size == 4096
    # the defaults of the dict fields are the dataclass's
    plain = engine_args_from_namespace(serve())
    assert plain.hf_overrides == {} and plain.override_generation_config == {} and plain.hf_token is None


def test_seed_command_line_parses():
    from pagedllm.entrypoints import openai_api_server

    ns = openai_api_server.build_parser().parse_args([
        "--model", "/models/llama-2-13b", "--tensor-parallel-size", "2", "--port", "8000",
        "--gpu-memory-utilization", "0.95", "--max-num-batched-tokens", "51200", "--disable-log-stats",
        "--cache-block-size", "4096", "--max-seq-length", "4096", "--swap-space", "10G",
        "--batch-wait-timeout", "100", "--max-num-seqs", "8",
    ])
    a = engine_args_from_namespace(ns)
    assert (a.model, a.tensor_parallel_size, ns.port, a.gpu_memory_utilization) == ("/models/llama-2-13b", 2, 8000, 0.95)
    assert (a.max_num_batched_tokens, a.disable_log_stats, a.block_size, a.max_model_len) == (51200, True, 4096, 4096)
    assert (a.swap_space, a.batch_wait_timeout, a.max_num_seqs) == (10.0, 100.0, 8)


@pytest.mark.parametrize("text,expected", [("10G", 10 << 30), ("10GiB", 10 << 30), ("512M", 512 << 20),
                                           ("512MiB", 512 << 20), ("1.5g", 3 << 29), ("4096", 4096)])
def test_sizes(text, expected):
    assert parse_size(text, "x") == expected


def test_vllm_kwargs_are_accepted_and_logged(tiny_llama, plain_tokens, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(
            tiny_llama, kv_cache_memory_bytes=8 << 20, max_model_len=128, trust_remote_code=True,
            enable_chunked_prefill=True, max_logprobs=3, async_scheduling=False, attention_backend="TORCH_SDPA",
            hf_overrides={"rms_norm_eps": 1e-6}, generation_config="vllm", override_generation_config={},
            disable_log_requests=True, enable_log_requests=False, max_num_partial_prefills=4,
            long_prefill_token_threshold=64, tokenizer_mode="auto", seed=None, swap_space="1G",
            gpu_memory_utilization=0.5, quantization=None, pipeline_parallel_size=1, kv_cache_dtype="auto",
        )
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == plain_tokens
    assert llm.llm_engine.config.attention_backend == "torch"
    assert llm.llm_engine.config.cache_config.kv_cache_memory == 8 << 20
    text = caplog.text
    for name in ("trust_remote_code=True", "max_num_partial_prefills=4", "long_prefill_token_threshold=64",
                 "disable_log_requests=True", "gpu_memory_utilization=0.5 does not apply on a CPU",
                 "swap_space=1 GiB is not used", "attention_backend=TORCH_SDPA"):
        assert text.count(name) == 1, name
    assert "tokenizer_mode" not in text  # at its default: nothing to say
    assert "device cpu, attention backend torch, dtype float32; scheduler: max_num_seqs 256" in text
    with pytest.raises(ValueError, match="max_logprobs=3"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=5), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_accepted_fields_say_what_happens_instead():
    for f in dataclasses.fields(EngineArgs):
        if f.metadata.get("status") == ACCEPTED:
            assert len(f.metadata["note"]) > 15, f.name


@pytest.mark.parametrize("kwargs,match", [
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False: pagedllm always"),
    (dict(quantization="int3"), "quantization must be one of fp8, gptq, awq, compressed-tensors"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype must be one of"),
    (dict(pipeline_parallel_size=5), "pipeline_parallel_size=5 is larger than the model's num_hidden_layers=2"),
    (dict(data_parallel_size=0), "data_parallel_size must be >= 1, got 0"),
    (dict(max_num_seq=4), r"unknown engine arguments: max_num_seq \(did you mean max_num_seqs\?\)"),
    (dict(enable_prefix_cache=True), "did you mean enable_prefix_caching"),
    (dict(attention_backend="FLASH_DANCE"), "attention_backend"),
    (dict(kv_cache_memory_bytes="2GiB"), "kv_cache_memory_bytes"),
    (dict(generation_config="/no/such/dir"), "generation_config"),
    (dict(block_size=12), "block_size must be a power of two"),
])
def test_refused_arguments(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, kv_cache_memory="8MiB", max_model_len=128, **kwargs)


def test_pending_flags_are_clear_errors_and_typos_fail(capsys):
    with pytest.raises(SystemExit):  # not a choice of --quantization
        serve("--quantization", "int3")
    with pytest.raises(ValueError, match="reasoning parsers"):
        engine_args_from_namespace(serve("--reasoning-parser", "deepseek_r1"))
    engine_args_from_namespace(serve("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))  # delivered
    engine_args_from_namespace(serve("--pipeline-parallel-size", "1"))  # the default passes
    capsys.readouterr()
    for typo in (["--max-num-seq", "8"], ["--max-num-seqs", "many"]):  # no abbreviations pass
        with pytest.raises(SystemExit) as e:
            serve(*typo)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and "error:" in err[-1] and typo[0] in err[-1]  # short, the error line last


def test_block_size_in_bytes_is_mapped(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        cfg = EngineArgs(model=tiny_llama, block_size=4096, kv_cache_memory="8MiB").create_engine_config()
    # tiny llama: head_dim 16, float32 on the CPU -> 64 bytes per token of one KV head
    assert cfg.cache_config.block_size == 64
    assert "block_size=4096 is more tokens than the paged kernels use" in caplog.text
    assert EngineArgs(model=tiny_llama, block_size=32).create_engine_config().cache_config.block_size == 32
