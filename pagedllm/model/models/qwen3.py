"""Qwen3: the Llama decoder with RMSNorm on each head of q and k (before rotary) and an
explicit head_dim; q/k/v biases follow `attention_bias` (off in released models)."""

from __future__ import annotations

from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3Attention(LlamaAttention):
    use_qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
