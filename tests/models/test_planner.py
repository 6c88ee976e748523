"""`pagedllm plan`: the memory plan from a config alone, checked against the engine's own
start-up plan on a tiny model, and its GPU arithmetic on the public benchmark configs."""

from __future__ import annotations

import json
import os

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm import LLM
from pagedllm.planner import GPUS, PlanInputs, build_plan, smallest_fix, stage_layer_counts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_8B = os.path.join(ROOT, "benchmarks", "configs", "llama-3.1-8b")
QWEN3_06B = os.path.join(ROOT, "benchmarks", "configs", "qwen3-0.6b")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, tokenizer_dir):
    return save_tiny_model(tiny_config("qwen3", layers=3, tie=True), str(tmp_path_factory.mktemp("plan_qwen3")),
                           tokenizer_dir)


def test_plan_equals_the_engines_startup_plan(tiny_qwen3, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=tiny_qwen3, kv_cache_memory="8MiB", max_model_len=512)
    # start-up says what it is doing through every slow phase, in order
    phases = ["loading the tokenizer", "loading Qwen3ForCausalLM", "KV cache plan", "allocating the KV cache",
              "KV cache allocated in", "engine ready in"]
    text = caplog.text
    positions = [text.find(p) for p in phases]
    assert -1 not in positions and positions == sorted(positions), list(zip(phases, positions))
    try:
        worker = llm.llm_engine.executor.worker
        plan = build_plan(PlanInputs(model=tiny_qwen3, device="cpu", kv_cache_memory=8 << 20, max_model_len=512))
        assert plan.weight_bytes_per_rank == worker.weight_bytes
        assert plan.num_blocks == worker.num_gpu_blocks == llm.llm_engine.scheduler.block_manager.num_blocks
        assert plan.kv_bytes_per_token * 16 == worker.bytes_per_block()
    finally:
        llm.llm_engine.shutdown()


def test_fp8_plan_equals_the_engine(tiny_qwen3):
    """Online FP8 (emulated on the CPU): e4m3 projection weights plus a float32 scale per row."""
    llm = LLM(model=tiny_qwen3, kv_cache_memory="8MiB", max_model_len=512, quantization="fp8")
    try:
        worker = llm.llm_engine.executor.worker
        plan = build_plan(PlanInputs(model=tiny_qwen3, device="cpu", kv_cache_memory=8 << 20, max_model_len=512,
                                     quantization="fp8"))
        assert plan.weight_bytes_per_rank == worker.weight_bytes
    finally:
        llm.llm_engine.shutdown()


def test_hub_id_reads_only_the_config(tmp_path, monkeypatch):
    from hub_cache import add_repo

    home = str(tmp_path / "hf_home")
    add_repo(home, "meta-llama/Llama-3.1-8B", {"config.json": os.path.join(LLAMA_8B, "config.json")})
    monkeypatch.setenv("HF_HOME", home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = build_plan(PlanInputs(model="meta-llama/Llama-3.1-8B", max_model_len=8192))
    local = build_plan(PlanInputs(model=LLAMA_8B, max_model_len=8192))
    assert hub.to_dict() | {"inputs": None} == local.to_dict() | {"inputs": None}
    with pytest.raises(ValueError, match=r"org/missing.*Hugging Face cache .*offline"):
        build_plan(PlanInputs(model="org/missing"))


def test_gpu_arithmetic_on_llama_8b():
    plan = build_plan(PlanInputs(model=LLAMA_8B, max_model_len=8192))
    assert plan.dtype == "bfloat16" and plan.num_layers == 32
    assert abs(plan.weight_bytes_per_rank - 16.06e9) < 0.01e9  # 8.03B parameters in bf16
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head_dim 128
    budget = GPUS["H200"] * 0.9 - plan.weight_bytes_per_rank - plan.activation_bytes
    assert plan.kv_cache_bytes <= budget < plan.kv_cache_bytes + plan.kv_bytes_per_token * 16
    tp2 = build_plan(PlanInputs(model=LLAMA_8B, max_model_len=8192, tensor_parallel_size=2))
    assert abs(2 * tp2.weight_bytes_per_rank - plan.weight_bytes_per_rank) < 0.06 * plan.weight_bytes_per_rank
    assert tp2.kv_bytes_per_token * 2 == plan.kv_bytes_per_token
    fp8kv = build_plan(PlanInputs(model=LLAMA_8B, max_model_len=8192, kv_cache_dtype="fp8"))
    assert fp8kv.kv_bytes_per_token * 2 == plan.kv_bytes_per_token and fp8kv.tokens >= 2 * plan.tokens - 16
    fp8 = build_plan(PlanInputs(model=LLAMA_8B, max_model_len=8192, quantization="fp8"))
    assert 0.5 < fp8.weight_bytes_per_rank / plan.weight_bytes_per_rank < 0.6  # embeddings stay bf16


def test_pipeline_stages_and_a_plan_that_does_not_fit():
    assert stage_layer_counts(32, 1) == [32]
    assert stage_layer_counts(30, 4) == [8, 8, 7, 7] or sum(stage_layer_counts(30, 4)) == 30
    assert sum(stage_layer_counts(30, 4)) == 30 and max(stage_layer_counts(30, 4)) - min(stage_layer_counts(30, 4)) <= 1
    pp2 = build_plan(PlanInputs(model=QWEN3_06B, pipeline_parallel_size=2))
    assert pp2.stage_layers == [14, 14]
    small = build_plan(PlanInputs(model=LLAMA_8B, gpu_memory=GPUS["L4"]))  # 16 GB of weights on 22.5 GiB
    assert not small.fits
    fix = smallest_fix(small)
    assert fix is not None
    flag, value = fix.rsplit(" ", 1)
    key = {"--kv-cache-dtype": "kv_cache_dtype", "--quantization": "quantization",
           "--max-model-len": "max_model_len", "--tensor-parallel-size": "tensor_parallel_size"}[flag]
    fixed = build_plan(PlanInputs(model=LLAMA_8B, gpu_memory=GPUS["L4"],
                                  **{key: int(value) if value.isdigit() else value}))
    assert fixed.fits


def test_plan_command_line(capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["plan", QWEN3_06B, "--json", "--max-model-len", "4096", "--gpu", "H100"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["max_model_len"] == 4096 and doc["inputs"]["gpu_memory"] == GPUS["H100"]
    assert {"kv_cache_dtype=fp8", "tensor_parallel_size=2"} <= set(doc["what_if"])
    assert main(["plan", LLAMA_8B, "--gpu", "L4"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "smallest change that fits" in out
    assert main(["plan", "/nonexistent"]) == 2
    assert "model" in capsys.readouterr().err
