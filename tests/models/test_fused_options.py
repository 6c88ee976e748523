"""The fused path (PAGEDLLM_FUSED_ROPE_KV, on by default) on the CPU: the attention layers take the
flag, and with it on the CPU keeps the unfused attention (the fused kernel needs CUDA), plain and
FP8, with the greedy tokens of the option off. The fused kernel itself: tests/gpu/test_fused_gpu.py
and, under the interpreter, tests/unit/test_fused_interpret.py."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_model, tiny_config

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import SINGLE

PROMPTS = [[5, 77, 300, 12, 9000, 41], list(range(100, 137))]


def _tokens(path, quantization):
    llm = LLM(path, dtype="float32", quantization=quantization, max_model_len=256, kv_cache_memory="16MiB")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def test_layers_read_the_flags(monkeypatch):
    from pagedllm.model.models.gemma3 import Gemma3Attention
    from pagedllm.model.models.qwen3 import Qwen3Attention

    cfg = tiny_config("qwen3")
    monkeypatch.delenv("PAGEDLLM_FUSED_ROPE_KV", raising=False)
    assert Qwen3Attention(cfg, SINGLE).fuse_rope_kv, "on by default"
    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_KV", "0")
    assert not Qwen3Attention(cfg, SINGLE).fuse_rope_kv
    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_KV", "1")
    assert Qwen3Attention(cfg, SINGLE).fuse_rope_kv
    # Gemma 3's (1 + w) q/k norm is not the kernel's: it keeps the unfused path
    from transformers import Gemma3TextConfig

    gcfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_hidden_layers=2, vocab_size=1000)
    assert not Gemma3Attention(gcfg, SINGLE, 0).fuse_rope_kv


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_options_on_keep_cpu_tokens(tmp_path, tokenizer_dir, monkeypatch, quantization):
    path = save_tiny_model(tiny_config("qwen3", hidden=64, head_dim=16), str(tmp_path), tokenizer_dir, seed=2)
    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_KV", "0")
    off = _tokens(path, quantization)
    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_KV", "1")
    assert _tokens(path, quantization) == off


def test_decode_order_on_by_default(monkeypatch):
    """Longest-first decode order: on unless PAGEDLLM_DECODE_ORDER=0, whatever the cache."""
    pytest.importorskip("triton")
    from pagedllm.attention.registry import get_attention_backend

    monkeypatch.delenv("PAGEDLLM_DECODE_ORDER", raising=False)
    assert get_attention_backend("triton", "cuda").order_decodes
    monkeypatch.setenv("PAGEDLLM_DECODE_ORDER", "0")
    assert not get_attention_backend("triton", "cuda").order_decodes
    monkeypatch.setenv("PAGEDLLM_DECODE_ORDER", "1")
    assert get_attention_backend("triton", "cuda").order_decodes
