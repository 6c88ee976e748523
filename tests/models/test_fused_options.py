"""The fused path (PAGEDLLM_FUSED_ROPE_KV, on by default) on the CPU: the attention layers take the
flag, and with it on the CPU keeps the unfused attention (the fused kernel needs CUDA), plain and
FP8, with the greedy tokens of the option off. The fused kernel itself: tests/gpu/test_fused_gpu.py
and, under the interpreter, tests/unit/test_fused_interpret.py."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model, tiny_config

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


@pytest.mark.parametrize("arch, quantization", [("qwen3", None), ("llama", None), ("qwen3_moe", None),
                                                ("qwen2_moe", None), ("qwen3", "fp8")])
def test_residual_stream_keeps_cpu_tokens(tmp_path, tokenizer_dir, monkeypatch, arch, quantization):
    """PAGEDLLM_FUSED_NORM=1 (LlamaDecoderLayer.forward_stream: the layers pass the residual stream
    whole, the norms folded into the products that read them and the adds into those that end each
    half) is for CUDA decode batches; here it is let run on the CPU, where each product does its
    norm and add apart, to check the wiring: the greedy tokens (float32) of the plain path, dense
    and MoE (Qwen3-MoE's first layer is dense), with the stream path taken by every layer; Qwen2-MoE's
    shared expert keeps the plain path (and its tokens). FP8 weights: the quantized linears' own
    apply_stream (their CPU emulation normalizing and adding apart)."""
    from moe_utils import save_moe_model, tiny_moe_config

    from pagedllm.model.models.llama import LlamaDecoderLayer

    if arch in ("qwen3_moe", "qwen2_moe"):
        path = save_moe_model(tiny_moe_config(arch), str(tmp_path), tokenizer_dir)[0]
    else:
        path = save_tiny_model(tiny_config(arch, hidden=64, head_dim=16), str(tmp_path), tokenizer_dir, seed=2)
    monkeypatch.delenv("PAGEDLLM_FUSED_NORM", raising=False)
    off = _tokens(path, quantization)
    calls = []
    plain_stream = LlamaDecoderLayer.forward_stream

    def counted(self, *args):
        calls.append(type(self).__name__)
        return plain_stream(self, *args)

    monkeypatch.setenv("PAGEDLLM_FUSED_NORM", "1")
    monkeypatch.setattr(LlamaDecoderLayer, "stream_applies", lambda self, x: self.stream_layer_ok())
    monkeypatch.setattr(LlamaDecoderLayer, "forward_stream", counted)
    quantized = []
    if quantization:
        from pagedllm.model.layers.quantization.fp8 import Fp8LinearMethod

        plain_apply = Fp8LinearMethod.apply_stream
        monkeypatch.setattr(Fp8LinearMethod, "apply_stream",
                            lambda self, *a: quantized.append(1) or plain_apply(self, *a))
    assert _tokens(path, quantization) == off
    assert bool(quantized) == bool(quantization), "the FP8 linears' apply_stream"
    if arch == "qwen2_moe":
        assert not calls
    else:  # every layer of every step (a layer off the path would leave the ones after it off too)
        layers = 3 if arch == "qwen3_moe" else 2
        assert calls and len(calls) % layers == 0, calls
