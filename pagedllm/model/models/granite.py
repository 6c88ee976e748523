"""Granite (IBM): the Llama decoder with four scalars from its config: the embeddings times
`embedding_multiplier`, each attention and MLP output times `residual_multiplier` before it
joins the residual, `attention_multiplier` as the softmax scale, and the logits divided by
`logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteAttention(LlamaAttention):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        self.attn.scale = float(cfg.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, positions, x, residual, batch):
        # x arrives scaled by the previous layer; x + residual is the layer's input
        x, residual = self.norm_input(x, residual)
        x = self.self_attn(positions, x, batch) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        self.embedding_multiplier = float(cfg.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        super().__init__(cfg, ps)
        self.logits_scaling = float(cfg.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
