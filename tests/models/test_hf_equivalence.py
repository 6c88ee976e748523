"""Greedy token ids equal transformers' generate, exactly, in float32 on CPU: one prompt, a
batch of different lengths, chunked prefill, prefix-cache hits, preemption (recompute and
swap); logprobs equal HF's log-softmax within 1e-4."""

from __future__ import annotations

import random

import pytest
import torch

from tiny_models import copy_tokenizer, save_tiny_model, tiny_config
from pagedllm import LLM, SamplingParams

MODELS = {
    "llama-gqa": ("llama", dict(tie=False, heads=4, kv_heads=2)),
    "llama-tied-mqa": ("llama", dict(tie=True, heads=4, kv_heads=1)),
    "qwen2-gqa": ("qwen2", dict(tie=False, heads=4, kv_heads=2)),
    "qwen2-tied": ("qwen2", dict(tie=True, heads=2, kv_heads=2)),
    "qwen3-gqa": ("qwen3", dict(tie=False, heads=4, kv_heads=2, head_dim=32)),
    "qwen3-tied": ("qwen3", dict(tie=True, heads=8, kv_heads=2, head_dim=16)),
    "llama3-rope-scaling": ("llama", dict(tie=False, heads=4, kv_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
}
MAX_NEW = 12


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory, tokenizer_dir):
    arch, kw = MODELS[request.param]
    path = save_tiny_model(tiny_config(arch, **kw), str(tmp_path_factory.mktemp(request.param)), tokenizer_dir, seed=1)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_greedy(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def check(llm: LLM, hf, prompts: list[list[int]], params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p), f"prompt of {len(p)} tokens differs"
    distinct = {t for o in outs for t in o.outputs[0].token_ids}
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    assert len(distinct) >= total // 2, "the tiny model should produce varied tokens"
    return outs


def test_single_prompt(model):
    path, hf = model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512)
    check(llm, hf, prompts_of([23]))
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == llm.llm_engine.scheduler.block_manager.num_blocks


def test_batch_of_different_lengths(model):
    path, hf = model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512)
    check(llm, hf, prompts_of([1, 5, 17, 33, 64, 100, 2, 49], seed=1))


def test_chunked_prefill(model):
    path, hf = model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=24, max_num_seqs=4)
    check(llm, hf, prompts_of([90, 61, 7, 130], seed=2))


def test_prefix_cache_hits(model):
    path, hf = model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512, block_size=8)
    shared = prompts_of([45], seed=3)[0]
    tails = prompts_of([3, 11, 20, 1], seed=4)
    check(llm, hf, [shared + tails[0]])
    check(llm, hf, [shared + t for t in tails[1:]])
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 3 * 40, stats


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(model, mode):
    path, hf = model
    llm = LLM(path, block_size=4, max_model_len=96, max_num_seqs=8, preemption_mode=mode, swap_space=0.01,
              kv_cache_memory=_bytes_for_blocks(path, 4, 40))
    assert llm.llm_engine.scheduler.block_manager.num_blocks == 40
    check(llm, hf, prompts_of([20, 33, 9, 27, 14, 30, 5, 24], seed=5))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert llm.llm_engine.scheduler.num_swap_outs > 0
    assert stats.num_free_blocks == 40


def _bytes_for_blocks(path: str, block_size: int, n: int) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return n * 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * head_dim * 4


def test_logprobs_match_hf(model):
    path, hf = model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512)
    prompt = prompts_of([19], seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    full = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(5)
        for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(lps[tid].logprob - lp) < 1e-4
        assert lps[tok].rank == 1  # greedy picks the top token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
    assert abs(comp.cumulative_logprob - sum(ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(comp.token_ids))) < 1e-3


@pytest.mark.parametrize("seed", [11, 12])
def test_unseen_random_config(tmp_path, tokenizer_dir, seed):
    """A config drawn at random (architecture, heads, kv heads, head_dim, depth, tying)."""
    rng = random.Random(seed)
    arch = rng.choice(["llama", "qwen2", "qwen3"])
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2, 3])
    head_dim = rng.choice([16, 32, 64])
    cfg = tiny_config(arch, tie=rng.random() < 0.5, layers=rng.choice([1, 2, 3]), heads=heads, kv_heads=kv,
                      hidden=heads * head_dim if arch != "qwen3" else 96, head_dim=head_dim)
    path = save_tiny_model(cfg, str(tmp_path), tokenizer_dir, seed=seed)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=32, block_size=8)
    check(llm, hf, prompts_of([rng.randrange(1, 70) for _ in range(5)], seed=seed))


def test_sharded_checkpoint(tmp_path, tokenizer_dir):
    """A checkpoint split over several safetensors files with an index loads the same model."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen2", heads=4, kv_heads=2)
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path), max_shard_size="2MB")
    import os

    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    copy_tokenizer(tokenizer_dir, tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="8MiB", max_model_len=256)
    check(llm, hf, prompts_of([12, 30], seed=8))
