"""OLMo 2, GLM-4, Granite, StarCoder2, GPT-2 and GPT-NeoX: tiny random checkpoints (written by
transformers' save_pretrained, initializer_range 0.3 so tokens vary) give transformers' greedy
token ids exactly in float32 on the CPU: one prompt, 8 prompts at once, chunked prefill,
prefix-cache hits, preemption (recompute; swap for one); logprobs within 1e-4 of HF's
log-softmax. StarCoder2 also with a sliding window (16) shorter than most prompts. Also:
random ("dummy") weights (GGUF files: tests/models/test_archs_gguf.py)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from arch_configs import arch_config
from tiny_models import VOCAB, copy_tokenizer, save_tiny_model
from pagedllm import LLM, SamplingParams

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ARCHS = ["glm4", "gpt2", "gpt_neox", "granite", "olmo2", "starcoder2"]


@pytest.fixture(scope="module", params=ARCHS + ["gpt_neox-sequential", "starcoder2-window"])
def model(request, tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(arch_config(request.param), str(tmp_path_factory.mktemp(request.param)), tokenizer_dir,
                           seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def hf_greedy(hf, prompt: tuple[int, ...]) -> list[int]:
    return _hf_greedy(hf, prompt)


@functools.lru_cache(maxsize=None)
def _hf_greedy(hf, prompt: tuple[int, ...]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


def check(llm: LLM, hf, prompts: list[list[int]]) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, tuple(p)), f"prompt of {len(p)} tokens differs"
    distinct = {t for o in outs for t in o.outputs[0].token_ids}
    assert len(distinct) >= sum(len(o.outputs[0].token_ids) for o in outs) // 2, "the model should vary its tokens"


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.llm_engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks


def test_one_prompt_then_eight_and_logprobs(model):
    _, path, hf = model
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512)
    check(llm, hf, prompts_of([23]))
    check(llm, hf, prompts_of([1, 5, 17, 33, 64, 100, 2, 49], seed=1))
    assert all_blocks_free(llm)
    prompt = prompts_of([19], seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + comp.token_ids])).logits[0].float(), dim=-1)
    for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert lps[tok].rank == 1
        for lp, tid in zip(*row.topk(4)):
            assert abs(lps[int(tid)].logprob - float(lp)) < 1e-4
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4


def test_chunked_prefill_and_prefix_hits(model):
    name, path, hf = model
    if name.endswith("-sequential"):
        pytest.skip("the sequential-residual variant runs the first test only")
    llm = LLM(path, kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=24, max_num_seqs=4,
              block_size=8)
    check(llm, hf, prompts_of([90, 61, 7, 130], seed=2))  # prompts of up to 6 chunks
    shared = prompts_of([45], seed=3)[0]
    tails = prompts_of([3, 11, 20], seed=4)
    check(llm, hf, [shared + tails[0]])
    before = llm.llm_engine.get_stats().prefix_cache_hits
    check(llm, hf, [shared + t for t in tails[1:]])
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 2 * 40
    assert all_blocks_free(llm)


def test_preemption(model):
    name, path, hf = model
    if name.endswith("-sequential"):
        pytest.skip("the sequential-residual variant runs the first test only")
    from transformers import AutoConfig

    mode = "swap" if name == "gpt_neox" else "recompute"
    c = AutoConfig.from_pretrained(path)
    per_block = 2 * c.num_hidden_layers * 4 * (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) \
        * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * 4
    llm = LLM(path, block_size=4, max_model_len=96, max_num_seqs=8, preemption_mode=mode, swap_space=0.01,
              kv_cache_memory=40 * per_block)
    assert llm.llm_engine.scheduler.block_manager.num_blocks == 40
    check(llm, hf, prompts_of([20, 33, 9, 27, 14, 30, 5, 24], seed=5))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == 40
    if mode == "swap":
        assert llm.llm_engine.scheduler.num_swap_outs > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_weights(arch, tmp_path, tokenizer_dir):
    """load_format="dummy" builds the model from its config alone (no weights on disk) and runs."""
    from transformers import AutoModelForCausalLM

    cfg = arch_config(arch)
    cfg.architectures = [AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    cfg.save_pretrained(str(tmp_path))
    copy_tokenizer(tokenizer_dir, tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory="4MiB", max_model_len=128)
    outs = llm.generate(prompts_of([7, 30], seed=9), GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_NEW, MAX_NEW]
    assert all(0 <= t < VOCAB for o in outs for t in o.outputs[0].token_ids)
    assert all_blocks_free(llm)
