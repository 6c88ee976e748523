"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, as
`qkv_bias` says), routed experts plus a shared expert that every token runs, scaled by
sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.model.layers.fused_moe import SparseMoeBlock
from pagedllm.model.layers.linear import copy_checked, materialize
from pagedllm.model.models.llama import LlamaAttention
from pagedllm.model.models.moe import MoeForCausalLM, dense_mlp


class Qwen2MoeAttention(LlamaAttention):
    def __init__(self, cfg: Any, ps: ParallelState):
        self.qkv_bias_default = bool(getattr(cfg, "qkv_bias", True))
        super().__init__(cfg, ps)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen2MoeAttention

    @staticmethod
    def add_shared_expert(block: SparseMoeBlock, cfg: Any, ps: ParallelState) -> None:
        size = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        if size:
            block.shared_expert = dense_mlp(cfg, ps, size)
            block.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
            block.shared_expert_gate.weight.weight_loader = _load_shared_gate  # type: ignore[attr-defined]


def _load_shared_gate(param, loaded, shard_id=None) -> None:
    """[1, H]; GGUF stores it as [H]."""
    t = materialize(loaded)
    copy_checked(param.data, t.unsqueeze(0) if t.dim() == 1 else t, "shared_expert_gate")
