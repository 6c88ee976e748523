"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (RMSNorm on q and k heads),
every layer sparse by default, softmax then top-k, renormalized when `norm_topk_prob`."""

from __future__ import annotations

from pagedllm.model.models.moe import MoeForCausalLM
from pagedllm.model.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention
