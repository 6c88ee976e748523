"""StarCoder2: the Llama decoder with LayerNorm (with bias), biases on every projection
(`use_bias`) and a plain GELU MLP (c_fc -> gelu_pytorch_tanh -> c_proj). Its checkpoint uses
Llama's names; the LM head is tied by default. Its `sliding_window` (every layer's) is the
shared one of LlamaModel and the attention backends."""

from __future__ import annotations

from typing import Any

from pagedllm.distributed import ParallelState
from pagedllm.model.layers.gelu_mlp import GeluMLP
from pagedllm.model.layers.layernorm import LayerNorm
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Starcoder2Attention(LlamaAttention):
    def biases(self, cfg: Any) -> tuple[bool, bool]:
        bias = bool(getattr(cfg, "use_bias", True))
        return bias, bias


class Starcoder2MLP(GeluMLP):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bool(getattr(cfg, "use_bias", True)), ps)


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Starcoder2Attention
    mlp_cls = Starcoder2MLP
    norm_cls = LayerNorm


class Starcoder2Model(LlamaModel):
    layer_cls = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_cls = Starcoder2Model
