"""Held-out configs (tests/held_out_configs.py: the published config.json of common
checkpoints, not written for these tests), shrunk to tiny random models and run on the CPU:
greedy token ids equal transformers' float32 generate for a batch of prompts that cross the
(shrunk) sliding windows, with chunked prefill and a prefix-cache hit, and every KV block is
free afterwards. Both sides parse the same config.json, written in the published form (v4 key
names such as rope_scaling "type", rotary_pct, rope_local_base_freq included); every norm
weight and bias is randomized too, so a wrong (1 + w) or a dropped bias shows."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from held_out_configs import GEMMA_3_4B_IT, PUBLISHED, VOCAB, gemma3_text_part, shrink
from pagedllm import LLM, SamplingParams
from tiny_models import copy_tokenizer

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
CONFIGS = {**PUBLISHED, "gemma-3-4b-it (text part)": gemma3_text_part(GEMMA_3_4B_IT)}


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def write_model(config: dict, out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    """A random checkpoint of `config` in out_dir, its config.json exactly `config`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir), dtype=torch.float32)
    gemma = config["model_type"].startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif p.dim() == 1:  # norm weights (Gemma's are the w of 1 + w)
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if gemma else 1.0))
        if gemma:  # its embeddings enter times sqrt(hidden): smaller ones, so that the tied head
            # does not just repeat the last token
            model.get_input_embeddings().weight.mul_(0.25 * model.config.get_text_config().hidden_size ** -0.5)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:  # the published form, not v5's rewrite
        json.dump(config, f)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def hf_greedy(hf, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def check(llm: LLM, hf, prompts: list[list[int]], params: SamplingParams = GREEDY) -> None:
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, params.max_tokens), f"prompt of {len(p)} tokens differs"
    distinct = {t for o in outs for t in o.outputs[0].token_ids}
    assert len(distinct) >= sum(len(o.outputs[0].token_ids) for o in outs) // 3, "the model should vary its tokens"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_held_out_config_equals_transformers(name, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    path = write_model(shrink(CONFIGS[name]), str(tmp_path), tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, max_model_len=256, block_size=8, max_num_batched_tokens=32, kv_cache_memory="16MiB")
    shared = prompts_of([40], seed=1)[0]
    check(llm, hf, prompts_of([100, 7, 61], seed=2) + [shared + prompts_of([9], seed=3)[0]])
    before = llm.llm_engine.get_stats().prefix_cache_hits
    check(llm, hf, [shared + prompts_of([20], seed=4)[0]])
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 40
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("name", ["phi-3-mini-128k", "phi-4-mini"])
def test_longrope_past_its_original_context(name, tmp_path, tokenizer_dir):
    """The published LongRoPE factors past the original 4,096 tokens (Phi-4-mini's over its
    partial rotary): served with max_model_len 8192 the engine rotates by the long factors, as
    HF does at this length."""
    from transformers import AutoModelForCausalLM

    path = write_model(shrink(PUBLISHED[name]), str(tmp_path), tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, max_model_len=8192, block_size=16, max_num_batched_tokens=4200, kv_cache_memory="64MiB")
    check(llm, hf, prompts_of([4120], seed=5), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))


def test_gemma3_vision_checkpoint_serves_its_text_model(tmp_path, tokenizer_dir):
    """gemma-3-4b-it's own config (Gemma3ForConditionalGeneration: its sparse text_config shrunk,
    a one-layer SigLIP tower): the engine builds the text model from text_config, skips the
    vision tensors in the checkpoint, and its greedy tokens equal transformers' vision-language
    model on text prompts; dummy weights run from the config alone."""
    from transformers import AutoModelForCausalLM

    vision = dict(GEMMA_3_4B_IT["vision_config"], hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_hidden_layers=1, image_size=28)
    config = dict(GEMMA_3_4B_IT, text_config=shrink(GEMMA_3_4B_IT["text_config"]), vision_config=vision,
                  mm_tokens_per_image=4)
    path = write_model(config, str(tmp_path), tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    llm = LLM(path, max_model_len=256, block_size=8, max_num_batched_tokens=32, kv_cache_memory="16MiB")
    assert llm.llm_engine.config.model_config.architecture == "Gemma3ForConditionalGeneration"
    check(llm, hf, prompts_of([100, 7, 61, 30], seed=2))
    dummy = LLM(path, load_format="dummy", max_model_len=128, kv_cache_memory="4MiB")  # from the config alone
    outs = dummy.generate(prompts_of([5, 30], seed=6), GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_NEW, MAX_NEW]
