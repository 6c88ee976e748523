"""Tensor parallelism (CPU, gloo, 2 ranks) for the architectures of tests/arch_configs.py that
shard differently from Llama: GPT-NeoX (fused per-head query_key_value split at load, partial
rotary, LayerNorm, biased GELU MLP) and OLMo 2 (RMSNorm over all q heads and all k heads,
all-reduced across the ranks). TP=2 gives TP=1's greedy tokens and logprobs within 1e-4, over
mixed lengths, chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest

from arch_configs import arch_config
from tiny_models import save_tiny_model
from pagedllm import SamplingParams
from tp_utils import engine, one_thread, prompts_of, token_ids

pytestmark = pytest.mark.timeout(300)
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=32, block_size=8)


def workload(llm) -> tuple[list[list[int]], object]:
    shared = prompts_of([30], seed=7)[0]
    ids = token_ids(llm, prompts_of([1, 9, 40, 70], seed=1) + [shared + t for t in prompts_of([3, 11], seed=8)])
    ids += token_ids(llm, [shared + prompts_of([5], seed=9)[0]])  # a prefix-cache hit
    lp = llm.generate(prompts_of([15], seed=3), SamplingParams(temperature=0.0, max_tokens=4, logprobs=3,
                                                               ignore_eos=True), use_tqdm=False)[0]
    return ids, lp


@pytest.mark.parametrize("arch", ["gpt_neox", "olmo2"])
def test_tp2_matches_tp1(arch, tmp_path, tokenizer_dir):
    path = save_tiny_model(arch_config(arch), str(tmp_path), tokenizer_dir, seed=4)
    with one_thread():
        with engine(path, **ENGINE) as llm:
            ref_ids, ref_lp = workload(llm)
    with engine(path, tensor_parallel_size=2, **ENGINE) as llm:
        ids, lp = workload(llm)
        assert llm.llm_engine.get_stats().prefix_cache_hits >= 24
    assert ids == ref_ids
    assert lp.outputs[0].token_ids == ref_lp.outputs[0].token_ids
    for a, b in zip(ref_lp.outputs[0].logprobs, lp.outputs[0].logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
