"""Mixture-of-experts models greedy-equal to transformers in float32 on the CPU: tiny random
Qwen3-MoE (renormalized top-k, one dense layer), Qwen2-MoE (shared expert, its sigmoid gate,
q/k/v biases) and Mixtral (top-2, block_sparse_moe names): one prompt, 8 prompts at once,
chunked prefill, prefix-cache hits, preemption; checkpoints with experts one by one (what
save_pretrained writes) and stacked (transformers' in-memory layout); dummy weights; the expert
load counters; the parameter counts of the startup log."""

from __future__ import annotations

import os

import pytest

from moe_utils import save_moe_model, tiny_moe_config
from pagedllm import LLM, SamplingParams
from test_hf_equivalence import _bytes_for_blocks, check, prompts_of

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=512)


@pytest.fixture(scope="module", params=ARCHS)
def moe_model(request, tmp_path_factory, tokenizer_dir):
    return save_moe_model(tiny_moe_config(request.param), str(tmp_path_factory.mktemp(request.param)), tokenizer_dir)


# one set of prompts for every engine setting: 8 prompts; those over 24 tokens are prefilled in
# chunks under max_num_batched_tokens=24; 40 blocks of 4 tokens cannot hold them all (preemption)
PROMPTS = prompts_of([20, 33, 9, 27, 14, 30, 5, 24], seed=5)


def test_one_prompt_and_expert_load(moe_model):
    path, hf = moe_model
    llm = LLM(path, **ENGINE)
    prompt = PROMPTS[1]
    check(llm, hf, [prompt])
    model = llm.llm_engine.executor.worker.model
    cfg = hf.config
    sparse_layers = sum(1 for layer in model.model.layers if layer.is_sparse)
    # every token run (the prompt and all generated tokens but the last) picks top_k experts per sparse layer
    tokens = len(prompt) + 12 - 1
    assert sum(model.expert_load()) == tokens * sparse_layers * cfg.num_experts_per_tok
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # the engine's stats and the Prometheus counter of the (single, tensor-parallel) expert group
    stats = llm.llm_engine.get_stats()
    assert stats.expert_load == model.expert_load() and stats.expert_load_per_rank == [sum(stats.expert_load)]
    prometheus_client = pytest.importorskip("prometheus_client")
    from pagedllm.engine.metrics import IterationStats, PrometheusStatLogger

    registry = prometheus_client.CollectorRegistry()
    PrometheusStatLogger("m", registry, 512).record(stats, IterationStats(), 0.0)
    value = registry.get_sample_value("pagedllm:moe_expert_group_tokens_total", {"model_name": "m", "expert_group": "0"})
    assert value == sum(stats.expert_load)


def test_eight_prompts(moe_model):
    path, hf = moe_model
    check(LLM(path, **ENGINE), hf, PROMPTS)


def test_chunked_prefill_and_prefix_hits(moe_model):
    path, hf = moe_model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=24, max_num_seqs=4, block_size=8)
    check(llm, hf, PROMPTS)
    shared = PROMPTS[1] + PROMPTS[3]  # 60 tokens, 7 full blocks of 8 cached by the first
    check(llm, hf, [shared + [7, 8]])
    check(llm, hf, [shared + [9], shared + [10, 11, 12]])
    assert llm.llm_engine.get_stats().prefix_cache_hits >= 2 * 56


def test_preemption(moe_model):
    path, hf = moe_model
    llm = LLM(path, block_size=4, max_model_len=96, max_num_seqs=8, preemption_mode="recompute",
              kv_cache_memory=_bytes_for_blocks(path, 4, 40))
    check(llm, hf, PROMPTS)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == 40


def test_stacked_expert_checkpoint(tmp_path, tokenizer_dir):
    path, hf = save_moe_model(tiny_moe_config("mixtral"), str(tmp_path), tokenizer_dir, seed=3, stacked=True)
    check(LLM(path, **ENGINE), hf, PROMPTS[:3])


def test_dummy_weights_and_param_counts(tmp_path, tokenizer_dir):
    from pagedllm.model.layers.fused_moe import param_counts
    from pagedllm.model.models.qwen3_moe import Qwen3MoeForCausalLM

    cfg = tiny_moe_config("qwen3_moe")
    path, hf = save_moe_model(cfg, str(tmp_path), tokenizer_dir)
    total, active = param_counts(Qwen3MoeForCausalLM, cfg)
    assert total == sum(p.numel() for p in hf.parameters())  # untied: embedding and LM head
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    assert total - active == 2 * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert  # 2 sparse layers
    llm = LLM(path, load_format="dummy", **ENGINE)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_qwen3_30b_a3b_param_counts():
    """The benchmark config (benchmarks/configs/qwen3-30b-a3b): 30.5B parameters, 3.35B active."""
    from transformers import AutoConfig

    from pagedllm.model.layers.fused_moe import param_counts
    from pagedllm.model.models.qwen3_moe import Qwen3MoeForCausalLM

    here = os.path.dirname(os.path.abspath(__file__))
    cfg = AutoConfig.from_pretrained(os.path.join(here, "..", "..", "benchmarks", "configs", "qwen3-30b-a3b"))
    total, active = param_counts(Qwen3MoeForCausalLM, cfg)
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 2) == 3.35, (total, active)
    # `pagedllm plan`: the same counts; at TP=2 each rank holds half the experts' bytes either way
    from pagedllm.planner import PlanInputs, build_plan

    path = os.path.join(here, "..", "..", "benchmarks", "configs", "qwen3-30b-a3b")
    one = build_plan(PlanInputs(model=path))
    assert one.moe_params == (total, active) and one.total_params == total
    for ep in (False, True):
        two = build_plan(PlanInputs(model=path, tensor_parallel_size=2, enable_expert_parallel=ep))
        assert abs(two.weight_bytes_per_rank / one.weight_bytes_per_rank - 0.5) < 0.01


def test_bad_expert_parallel_settings(moe_model):
    path, _ = moe_model
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        LLM(path, tensor_parallel_size=3, enable_expert_parallel=True, **ENGINE)
