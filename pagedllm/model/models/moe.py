"""The decoder of the mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): the Llama
decoder whose MLP is, on the sparse layers, a router and experts (model/layers/fused_moe.py).
A model class names its attention, how its config spells the MoE sizes, and its routing.

Which layers are sparse follows transformers: not in `mlp_only_layers`, and every
`decoder_sparse_step`-th layer (all of them by default); the others keep a dense MLP of
`intermediate_size`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.attention.backend import ForwardBatch
from pagedllm.distributed import ParallelState
from pagedllm.model.layers.fused_moe import SparseMoeBlock, config_num_experts, expert_load_modules, load_expert_weight
from pagedllm.model.layers.layernorm import RMSNorm
from pagedllm.model.layers.pipeline import belongs_elsewhere
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


def dense_mlp(cfg: Any, ps: ParallelState, intermediate_size: int) -> LlamaMLP:
    """A gated MLP of the given size (the shared expert, or a dense layer of an MoE model)."""
    return LlamaMLP(SimpleNamespace(hidden_size=cfg.hidden_size, intermediate_size=intermediate_size,
                                    mlp_bias=False), ps)


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: Any, ps: ParallelState, layer_idx: int, arch: "type[MoeForCausalLM]"):
        nn.Module.__init__(self)
        self.self_attn = arch.attention_cls(cfg, ps)
        num_experts = arch.num_experts(cfg)
        sparse = (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and num_experts > 0
                  and (layer_idx + 1) % int(getattr(cfg, "decoder_sparse_step", 1) or 1) == 0)
        self.is_sparse = sparse
        if sparse:
            self.mlp: nn.Module = SparseMoeBlock(
                cfg, ps, num_experts=num_experts, top_k=cfg.num_experts_per_tok,
                intermediate_size=arch.expert_intermediate_size(cfg), renormalize=arch.renormalize(cfg),
                expert_parallel=ps.enable_expert_parallel)
            arch.add_shared_expert(self.mlp, cfg, ps)
        else:
            self.mlp = dense_mlp(cfg, ps, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run_mlp(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # padding rows (slot -1) are computed but not counted in the expert load
        return self.mlp(x, batch.slot_mapping) if self.is_sparse else self.mlp(x)


class MoeModel(LlamaModel):
    def __init__(self, cfg: Any, ps: ParallelState, arch: "type[MoeForCausalLM]"):
        super().__init__(cfg, ps, lambda i: MoeDecoderLayer(cfg, ps, i, arch))


class MoeForCausalLM(LlamaForCausalLM):
    attention_cls: type[nn.Module] = LlamaAttention
    # checkpoint module names -> ours (Mixtral's block_sparse_moe is our mlp)
    renames: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def num_experts(cfg: Any) -> int:
        return config_num_experts(cfg)

    @staticmethod
    def expert_intermediate_size(cfg: Any) -> int:
        return int(cfg.moe_intermediate_size)

    @staticmethod
    def renormalize(cfg: Any) -> bool:
        return bool(getattr(cfg, "norm_topk_prob", False))

    @staticmethod
    def add_shared_expert(block: SparseMoeBlock, cfg: Any, ps: ParallelState) -> None:
        pass

    def build_model(self, cfg: Any, ps: ParallelState) -> nn.Module:
        return MoeModel(cfg, ps, type(self))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()

        def others():
            for name, tensor in weights:
                for old, new in self.renames:
                    name = name.replace(old, new)
                if belongs_elsewhere(name, self.ps) and "embed_tokens" not in name:
                    continue  # another pipeline stage's layer (the tied embedding is handled below)
                target = load_expert_weight(params, modules, name, tensor)
                if target is None:
                    yield name, tensor
                else:
                    loaded.add(target)

        return super().load_weights(others()) | loaded

    # ---- expert load ------------------------------------------------------------------
    def expert_load(self) -> list[int]:
        """Tokens routed to each expert since the last reset, summed over the layers (a host
        sync; the engine reads it through ExpertLoadReader instead)."""
        mods = expert_load_modules(self)
        return torch.stack([m.expert_load for m in mods]).sum(0).tolist() if mods else []


def gguf_moe_config(path: str, cfg: Any) -> None:
    """What transformers' GGUF config reader leaves out for Qwen2-MoE / Qwen3-MoE: the experts'
    and the shared expert's sizes (`{arch}.expert_feed_forward_length`,
    `expert_shared_feed_forward_length`), and Qwen3-MoE's renormalized top-k, which llama.cpp
    applies to every qwen3moe model."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]

    def value(key: str):
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    if value("expert_feed_forward_length") is not None:
        cfg.moe_intermediate_size = value("expert_feed_forward_length")
    if value("expert_shared_feed_forward_length") is not None:
        cfg.shared_expert_intermediate_size = value("expert_shared_feed_forward_length")
    if cfg.model_type == "qwen3_moe":
        cfg.norm_topk_prob = True
