"""The embedded real model: SmolLM2-135M-Instruct from its GGUF file."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path


@pytest.fixture(scope="module")
def smol():
    return LLM(kv_cache_memory="256MiB", max_model_len=2048)


def test_capital_of_france(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends with <|im_end|>, not the length cap


def test_gguf_weights_match_transformers_gguf_loader(smol):
    """Our GGUF reader (dequantize + undo llama.cpp's q/k permutation) gives the same greedy
    tokens as transformers' own GGUF loading of the same file."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = smol.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ours = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=24, do_sample=False)
    assert ours.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    assert ours.outputs[0].finish_reason == "stop"


def test_plan_agrees_with_the_engines_startup_plan(smol):
    """`pagedllm plan` (config only, no weights read) gives the engine's own weight bytes and
    KV block count for the embedded model on the CPU, and its default CPU cache rule."""
    from pagedllm.planner import CPU_KV_CAP, PlanInputs, build_plan

    worker = smol.llm_engine.executor.worker
    plan = build_plan(PlanInputs(model=default_model_path(), device="cpu", kv_cache_memory=256 << 20,
                                 max_model_len=2048))
    assert abs(plan.weight_bytes_per_rank - worker.weight_bytes) <= 0.05 * worker.weight_bytes
    assert abs(plan.num_blocks - worker.num_gpu_blocks) <= 0.05 * worker.num_gpu_blocks
    assert plan.kv_bytes_per_token * 16 == worker.bytes_per_block()
    assert plan.fits and plan.max_model_len == 2048
    default = build_plan(PlanInputs(model=default_model_path(), device="cpu", available_ram=64 << 30))
    assert default.kv_cache_bytes <= CPU_KV_CAP and default.num_blocks == CPU_KV_CAP // worker.bytes_per_block()
