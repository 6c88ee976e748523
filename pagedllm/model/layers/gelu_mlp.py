"""The plain (ungated) GELU MLP of GPT-2, GPT-NeoX and StarCoder2: c_fc (column-parallel) ->
bias + GELU (one fused kernel, pagedllm.kernels.gelu) -> c_proj (row-parallel, bias added once
after the all-reduce)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.kernels.gelu import bias_gelu, gelu_approximation
from pagedllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear


class GeluMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = True,
                 ps: ParallelState = SINGLE):
        super().__init__()
        self.approximate = gelu_approximation(hidden_act)
        # c_fc's bias is left to the fused bias + GELU
        self.c_fc = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, ps=ps, skip_bias_add=True)
        self.c_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, ps=ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, I / tp] -> [T, H]
        return self.c_proj(bias_gelu(self.c_fc(x), self.c_fc.bias, self.approximate))
