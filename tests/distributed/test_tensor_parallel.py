"""Tensor parallelism on the CPU (gloo, one process per rank): TP=2 gives the token ids of
TP=1 exactly in float32 for tiny Llama, Qwen2 and Qwen3 models (split KV heads and a single
replicated one), through the offline LLM: mixed batches, chunked prefill, prefix-cache hits,
seeded sampling, logprobs, swap preemption."""

from __future__ import annotations

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from tp_utils import engine, one_thread, prompts_of, token_ids

pytestmark = pytest.mark.timeout(300)

MODELS = {
    "llama-gqa": ("llama", dict(heads=4, kv_heads=2)),
    "qwen2-gqa": ("qwen2", dict(heads=4, kv_heads=2)),
    "qwen3-gqa": ("qwen3", dict(heads=4, kv_heads=2, head_dim=32)),
    # one KV head, replicated on both ranks; tied embeddings share the vocab-parallel shard
    "qwen3-mqa-tied": ("qwen3", dict(tie=True, heads=4, kv_heads=1, head_dim=16)),
}
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=48, block_size=8)


@pytest.fixture(autouse=True)
def _routed(monkeypatch):
    with one_thread():
        yield


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_path(request, tmp_path_factory, tokenizer_dir):
    arch, kw = MODELS[request.param]
    return save_tiny_model(tiny_config(arch, **kw), str(tmp_path_factory.mktemp(request.param)), tokenizer_dir, seed=1)


def run_workload(llm) -> dict:
    """Everything compared between TP=1 and TP=2; prompts longer than the 48-token budget are
    prefilled in chunks, the second batch hits the prefix cache of the first."""
    shared = prompts_of([40], seed=7)[0]
    out = {
        "batch": token_ids(llm, prompts_of([1, 5, 17, 33, 64, 100, 2], seed=1)),
        "prefix": token_ids(llm, [shared + t for t in prompts_of([3, 11], seed=8)]),
        "prefix-again": token_ids(llm, [shared + t for t in prompts_of([20, 1], seed=9)]),
        "seeded": token_ids(llm, prompts_of([9, 30], seed=2),
                            SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=10, ignore_eos=True)),
    }
    lp = llm.generate(prompts_of([15], seed=3), SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                                               prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    out["logprobs"] = lp
    return out


def test_tp2_matches_tp1(model_path):
    with engine(model_path, **ENGINE) as llm:
        ref = run_workload(llm)
    with engine(model_path, tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        got = run_workload(llm)
        stats = llm.llm_engine.get_stats()
    for key in ("batch", "prefix", "prefix-again", "seeded"):
        assert got[key] == ref[key], key
    assert stats.prefix_cache_hits >= 40
    a, b = ref["logprobs"], got["logprobs"]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < 1e-4
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.keys() == y.keys()


def test_tp2_swap_preemption(tmp_path, tokenizer_dir):
    """Each rank swaps its own half of the KV heads out to CPU and back."""
    path = save_tiny_model(tiny_config("llama", heads=4, kv_heads=2), str(tmp_path), tokenizer_dir, seed=1)
    prompts = prompts_of([20, 33, 9, 27, 14, 30, 5, 24], seed=5)
    # 40 blocks of 4 tokens on every rank (each holds 1 of the 2 KV heads)
    per_block = 2 * 2 * 4 * 1 * 16 * 4
    kw = dict(block_size=4, max_model_len=96, max_num_seqs=8, preemption_mode="swap", swap_space=0.01)
    with engine(path, kv_cache_memory=80 * per_block, **kw) as llm:
        ref = token_ids(llm, prompts)
    with engine(path, tensor_parallel_size=2, kv_cache_memory=40 * per_block, **kw) as llm:
        assert llm.llm_engine.scheduler.block_manager.num_blocks == 40
        got = token_ids(llm, prompts)
        assert llm.llm_engine.scheduler.num_swap_outs > 0
    assert got == ref


def test_async_scheduling_under_tp(tmp_path, tokenizer_dir):
    """Every rank replays the engine's launch/collect order, so look-ahead steps stay in step."""
    from pagedllm.config import EngineArgs

    if "async_scheduling" not in EngineArgs.field_names():
        pytest.skip("the engine has no async_scheduling option yet")
    path = save_tiny_model(tiny_config("qwen2", heads=4, kv_heads=2), str(tmp_path), tokenizer_dir, seed=2)
    prompts = prompts_of([3, 40, 17, 90], seed=4)
    with engine(path, **ENGINE) as llm:
        ref = token_ids(llm, prompts)
    with engine(path, tensor_parallel_size=2, async_scheduling=True, **ENGINE) as llm:
        assert token_ids(llm, prompts) == ref
