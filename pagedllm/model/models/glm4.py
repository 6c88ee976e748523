"""GLM-4 (0414): the Llama decoder with a norm after each block as well as before it,

    h = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    out = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

q/k/v biases without an o_proj bias, and a partial rotary (`partial_rotary_factor`, 0.5) that
pairs dims (2i, 2i + 1): served by the rotate-half kernel after the q/k rows are permuted at
load (model/layers/partial_rotary.py). The checkpoint fuses gate and up in `gate_up_proj`."""

from __future__ import annotations

from typing import Any, Iterable

from pagedllm.distributed import ParallelState
from pagedllm.model.layers.layernorm import RMSNorm
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, norm_eps


class Glm4Attention(LlamaAttention):
    rotary_interleaved = True

    def biases(self, cfg: Any) -> tuple[bool, bool]:
        return bool(getattr(cfg, "attention_bias", True)), False


class Glm4DecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4Attention

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"GLM-4 with hidden_act={cfg.hidden_act!r} is not supported (silu)")
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, norm_eps(cfg))
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, norm_eps(cfg))

    def forward(self, positions, x, residual, batch):
        x, residual = self.norm_input(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(positions, x, batch))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    model_cls = Glm4Model

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        inter = self.config.intermediate_size
        for name, tensor in weights:
            if ".mlp.gate_up_proj." in name:  # rows: gate | up
                yield name.replace(".gate_up_proj.", ".gate_proj."), tensor.narrow(0, 0, inter)
                yield name.replace(".gate_up_proj.", ".up_proj."), tensor.narrow(0, inter, inter)
            else:
                yield name, tensor
