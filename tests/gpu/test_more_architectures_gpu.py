"""OLMo 2, GLM-4, Granite, StarCoder2, GPT-2 and GPT-NeoX on CUDA (Triton kernels: LayerNorm,
bias + GELU, the rotary with a partial / interleaved layout, paged attention; CUDA graphs):
float32 greedy tokens equal transformers float32 on the GPU, over mixed lengths, chunked
prefill and a prefix-cache hit."""

from __future__ import annotations

import random

import pytest
import torch

from arch_configs import arch_config
from tiny_models import save_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ["glm4", "gpt2", "gpt_neox", "granite", "olmo2", "starcoder2", "starcoder2-window"])
def test_float32_greedy_equals_hf_on_cuda(tmp_path, tokenizer_dir, arch):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    path = save_tiny_model(arch_config(arch), str(tmp_path), tokenizer_dir, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.2, max_num_seqs=16,
              max_num_batched_tokens=64, block_size=16)
    shared = prompts_of([40], seed=2)[0]
    prompts = prompts_of([1, 9, 33, 100, 130], seed=1) + [shared + [11], shared + [12, 13]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref, f"{arch}: prompt of {len(p)} tokens"
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
