"""Mixtral (8x7B, 8x22B): Llama's attention, `num_local_experts` experts of `intermediate_size`,
top-2 always renormalized. Checkpoints call the layer `block_sparse_moe` and the projections
w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

from pagedllm.model.models.moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    renames = ((".block_sparse_moe.", ".mlp."),)

    @staticmethod
    def num_experts(cfg: Any) -> int:
        return int(cfg.num_local_experts)

    @staticmethod
    def expert_intermediate_size(cfg: Any) -> int:
        return int(cfg.intermediate_size)

    @staticmethod
    def renormalize(cfg: Any) -> bool:
        return True
