"""StarCoder2: the Llama decoder with LayerNorm (with bias), biases on every projection
(`use_bias`) and a plain GELU MLP (c_fc -> gelu_pytorch_tanh -> c_proj). Its checkpoint uses
Llama's names; the LM head is tied by default."""

from __future__ import annotations

from typing import Any

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.layers.gelu_mlp import GeluMLP
from pagedllm.model.layers.layernorm import LayerNorm
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


def check_sliding_window(cfg: Any) -> None:
    """A sliding window shorter than the model's context would attend further than the model
    was trained to: refused (ValueError) until the attention backends honour it; a window of at
    least max_position_embeddings is the same as none (hf_overrides can lower the latter)."""
    window = getattr(cfg, "sliding_window", None)
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    if window is not None and int(window) < max_pos:
        raise ValueError(
            f"sliding_window={window} is shorter than max_position_embeddings={max_pos}, and this model's "
            f"sliding window is not supported yet; pass hf_overrides={{'max_position_embeddings': {window}}} "
            f"to serve contexts of up to {window} tokens exactly"
        )


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

    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        check_sliding_window(cfg)
        super().__init__(cfg, ps)
