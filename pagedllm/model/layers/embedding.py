"""Vocab-parallel embedding and LM head (rows of the vocabulary split across ranks; plain at
world size 1).

The vocabulary is padded up to a multiple of tp_size; rank r holds rows
[r * per_rank, (r + 1) * per_rank), and the padding rows (past vocab_size, on the last ranks)
are zeros that never reach the caller:

    vocab 10, tp 4 -> per_rank 3:  rank0 0..2 | rank1 3..5 | rank2 6..8 | rank3 9, pad, pad
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.kernels import cpu_gemm
from pagedllm.model.layers.linear import copy_checked


class VocabParallelEmbedding(nn.Module):
    # quantized rows (model/layers/quantization/gguf.py: `embed`, and `apply` for the LM head),
    # given at load; None: a plain weight
    quant_method = None

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState = SINGLE):
        super().__init__()
        self.ps = ps
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.per_rank = -(-vocab_size // ps.tp_size)
        self.start = ps.tp_rank * self.per_rank
        # rows of the real vocabulary this rank holds (0 on a rank that is all padding)
        self.num_real = max(0, min(self.per_rank, vocab_size - self.start))
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows, cols = int(loaded.shape[0]), int(loaded.shape[1])
        if rows != self.vocab_size or cols != self.hidden_size:
            raise ValueError(
                f"embedding shape mismatch: model ({self.vocab_size}, {self.hidden_size}), checkpoint ({rows}, {cols})"
            )
        n = self.num_real
        if n:
            copy_checked(param.data[:n], loaded.narrow(0, self.start, n))
        param.data[n:].zero_()

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        if self.ps.tp_size == 1:
            return self._rows(input_ids)
        # each rank embeds the ids it holds, zeros elsewhere; the all-reduce assembles them
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        y = self._rows(local.masked_fill(outside, 0))
        y.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.ps.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight: cpu_gemm.PackedWeight | None = None

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState = SINGLE, tied: bool = False):
        super().__init__(vocab_size, hidden_size, ps)
        # the checkpoint ties the head to the embedding (also on a pipeline stage that holds
        # only the head, which then loads the embedding's rows)
        self.tied = tied

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, H] -> local logits [S, per_rank] -> gathered [S, tp * per_rank] -> [S, vocab]
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden, None)
        else:
            logits = cpu_gemm.linear(hidden, self.weight, None, self.packed_weight)
        logits = self.ps.all_gather_last_dim(logits)
        return logits[:, : self.vocab_size]
