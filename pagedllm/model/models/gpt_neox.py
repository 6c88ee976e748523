"""GPT-NeoX (Pythia and kin): the Llama decoder with LayerNorm (with bias), a partial rotary
over the first `partial_rotary_factor` (`rotary_pct`) of each head, biases on the attention
projections, a plain GELU MLP, and the parallel residual (`use_parallel_residual`): attention
and MLP both read the layer's input,

    x + attn(ln_1(x)) + mlp(ln_2(x))        instead of   h = x + attn(ln_1(x)); h + mlp(ln_2(h))

The checkpoint's query_key_value holds each head's q, k and v rows side by side
([heads, 3, head_dim] rows); they are split into q_proj / k_proj / v_proj when loading."""

from __future__ import annotations

from typing import Any, Iterable

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.kernels.layernorm import layer_norm
from pagedllm.model.layers.gelu_mlp import GeluMLP
from pagedllm.model.layers.layernorm import LayerNorm
from pagedllm.model.layers.linear import materialize
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# checkpoint names (after the "gpt_neox." prefix) -> ours
_RENAMES = (
    ("embed_in.", "embed_tokens."),
    ("final_layer_norm.", "norm."),
    (".attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
    (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
)


class GPTNeoXAttention(LlamaAttention):
    def biases(self, cfg: Any) -> tuple[bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", True))
        return bias, bias


class GPTNeoXMLP(GeluMLP):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, True, ps)


class GPTNeoXDecoderLayer(LlamaDecoderLayer):
    attention_cls = GPTNeoXAttention
    mlp_cls = GPTNeoXMLP
    norm_cls = LayerNorm

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        self.use_parallel_residual = bool(getattr(cfg, "use_parallel_residual", True))

    def forward(self, positions, x, residual, batch):
        if not self.use_parallel_residual:
            return super().forward(positions, x, residual, batch)
        # x + residual is the layer's input; the next layer (or the final norm) adds what we return
        x, residual = self.norm_input(x, residual)
        ln = self.post_attention_layernorm
        mlp_out = self.mlp(layer_norm(residual, ln.weight, ln.bias, ln.eps))
        return self.self_attn(positions, x, batch) + mlp_out, residual


class GPTNeoXModel(LlamaModel):
    layer_cls = GPTNeoXDecoderLayer


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_cls = GPTNeoXModel

    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        super().__init__(cfg, ps)
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if name.endswith(".attention.bias") or name.endswith(".attention.masked_bias"):
                continue  # old checkpoints' causal-mask buffers
            if name.startswith("embed_out."):
                yield name.replace("embed_out.", "lm_head."), tensor
                continue
            name = name.replace("gpt_neox.", "model.", 1)
            for old, new in _RENAMES:
                name = name.replace(old, new)
            if ".attention.query_key_value." in name:
                # rows [heads, 3, head_dim] (bias: the same without the input dim)
                qkv = materialize(tensor)
                qkv = qkv.reshape(-1, 3, self.head_dim, *qkv.shape[1:])
                prefix = name.replace(".attention.query_key_value.", ".self_attn.{}_proj.")
                for i, part in enumerate("qkv"):
                    yield prefix.format(part), qkv[:, i].reshape(-1, *qkv.shape[3:])
                continue
            yield name, tensor
