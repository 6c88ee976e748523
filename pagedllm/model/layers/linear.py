"""Linear layers written for tensor parallelism, plain at world size 1.

Column-parallel splits the output features across ranks; row-parallel splits the input
features and all-reduces the partial sums. Weights are [out_features, in_features] like
nn.Linear. Every parameter carries a `weight_loader(param, loaded, shard_id)` that copies the
rank's slice of a checkpoint tensor into place, so fused layers (qkv, gate_up) load from the
separate checkpoint tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, ps: ParallelState = SINGLE):
        super().__init__()
        if out_features % ps.tp_size:
            raise ValueError(f"{out_features} output features do not split over tp_size={ps.tp_size}")
        self.ps = ps
        self.in_features = in_features
        self.out_per_rank = out_features // ps.tp_size
        self.weight = _set_loader(nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False), self.weight_loader)
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False), self.weight_loader)
            if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.out_per_rank
        param.data.copy_(loaded.narrow(0, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, ps: ParallelState = SINGLE):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, ps)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        tp = self.ps.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.ps.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; heads are split across ranks (kv heads are
    replicated when there are fewer of them than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, ps: ParallelState = SINGLE):
        tp = ps.tp_size
        if num_heads % tp:
            raise ValueError(f"num_attention_heads={num_heads} does not split over tp_size={tp}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, ps)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.ps.tp_rank if shard_id == "q" else self.ps.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, ps: ParallelState = SINGLE):
        super().__init__()
        if in_features % ps.tp_size:
            raise ValueError(f"{in_features} input features do not split over tp_size={ps.tp_size}")
        self.ps = ps
        self.in_per_rank = in_features // ps.tp_size
        self.weight = _set_loader(nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False), self.weight_loader)
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(out_features), requires_grad=False), default_weight_loader)
            if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.in_per_rank
        param.data.copy_(loaded.narrow(1, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = self.ps.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
