"""Vocab-parallel embedding and LM head (rows of the vocabulary split across ranks; plain at
world size 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState = SINGLE):
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // ps.tp_size)
        self.start = ps.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start : self.start + self.per_rank]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        if self.ps.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return self.ps.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, H] -> logits [S, vocab]
        logits = F.linear(hidden, self.weight)
        logits = self.ps.all_gather_last_dim(logits)
        return logits[:, : self.vocab_size]
