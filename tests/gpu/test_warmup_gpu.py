"""The engine's startup warm-up of mixed steps (worker/warmup.py; CUDA, skipped without it): no
decode kernel compiles while requests are served, and the warm-up leaves nothing behind (the tokens
equal transformers')."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fused_gpu import HAS_CUDA, _prompts, _tiny  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_no_decode_kernel_compiles_while_serving(tmp_path, tokenizer_dir, monkeypatch, arch):
    """Prompts of 1-100 tokens in 64-token chunks beside running decodes (mixed steps of one and of
    several decodes, split and not) after the warm-up: the JIT cache hook sees no decode kernel,
    and the greedy tokens are transformers'."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels._triton import recorded_compiles

    monkeypatch.delenv("PAGEDLLM_FUSED_ROPE_KV", raising=False)
    monkeypatch.delenv("PAGEDLLM_FUSED_ROPE_DECODE", raising=False)
    path = _tiny(arch, tmp_path, tokenizer_dir)
    prompts = _prompts() + [[7] * 300, [9] * 40]
    llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16,
              max_num_batched_tokens=64, block_size=16)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with recorded_compiles() as compiled:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    assert compiled is not None and not [c for c in compiled if "_decode" in c], compiled
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert list(o) == ref
