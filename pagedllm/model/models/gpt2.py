"""GPT-2: the Llama decoder with learned absolute position embeddings (wpe, added to the token
embeddings) instead of a rotary, LayerNorm (with bias), biases everywhere and a plain GELU MLP
(`activation_function`, gelu_new). The LM head is tied to wte.

Its checkpoint stores projections as Conv1D weights, [in, out]: transposed to nn.Linear's
[out, in] when loading, and c_attn's columns split into q, k and v."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.layers.gelu_mlp import GeluMLP
from pagedllm.model.layers.layernorm import LayerNorm
from pagedllm.model.layers.linear import default_weight_loader, materialize
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

_UNSUPPORTED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
# checkpoint names (after "transformer.") -> ours; the Conv1D ones are transposed
_RENAMES = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "norm", "ln_1": "input_layernorm",
            "ln_2": "post_attention_layernorm", "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.c_fc",
            "mlp.c_proj": "mlp.c_proj"}


class GPT2Attention(LlamaAttention):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        if not getattr(cfg, "scale_attn_weights", True):
            self.attn.scale = 1.0

    def biases(self, cfg: Any) -> tuple[bool, bool]:
        return True, True

    def make_rotary(self, cfg: Any) -> None:
        return None  # positions are learned embeddings, added in GPT2Model.embed


class GPT2MLP(GeluMLP):
    def __init__(self, cfg: Any, ps: ParallelState):
        inner = getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size
        super().__init__(cfg.hidden_size, inner, cfg.activation_function, True, ps)


class GPT2DecoderLayer(LlamaDecoderLayer):
    attention_cls = GPT2Attention
    mlp_cls = GPT2MLP
    norm_cls = LayerNorm


class GPT2Model(LlamaModel):
    layer_cls = GPT2DecoderLayer

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        # replicated on every rank: [max_positions, H]
        self.embed_positions = nn.Parameter(torch.empty(cfg.max_position_embeddings, cfg.hidden_size),
                                            requires_grad=False)
        self.embed_positions.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # [T] -> [T, H]
        return self.embed_tokens(input_ids) + F.embedding(positions, self.embed_positions)


class GPT2LMHeadModel(LlamaForCausalLM):
    model_cls = GPT2Model

    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        for name in _UNSUPPORTED:
            if getattr(cfg, name, False):
                raise ValueError(f"GPT-2 with {name}=True is not supported")
        super().__init__(cfg, ps)
        self.hidden_size = cfg.hidden_size

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers of old checkpoints
            # the head (skipped when tied), and names that are ours already (a GGUF file's)
            if name.startswith(("model.", "lm_head.")):
                yield name, tensor
                continue
            name = name.removeprefix("transformer.")
            layer = ""
            if name.startswith("h."):
                _, idx, name = name.split(".", 2)
                layer = f"layers.{idx}."
            module, kind = name.rsplit(".", 1)
            if module == "attn.c_attn":  # [H, 3H] columns q | k | v (bias: [3H])
                w = materialize(tensor)
                w = w.t() if kind == "weight" else w
                for part, chunk in zip("qkv", w.split(self.hidden_size, dim=0)):
                    yield f"model.{layer}self_attn.{part}_proj.{kind}", chunk
                continue
            if module not in _RENAMES:
                raise ValueError(f"checkpoint tensor {name} matches no parameter of GPT2LMHeadModel")
            ours = f"model.{layer}{_RENAMES[module]}"
            if module == "wpe":
                yield ours, tensor  # a bare parameter of GPT2Model
            elif module.startswith(("attn.", "mlp.")) and kind == "weight":
                yield f"{ours}.weight", materialize(tensor).t()  # Conv1D [in, out] -> [out, in]
            else:
                yield f"{ours}.{kind}", tensor
