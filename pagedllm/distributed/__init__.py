"""Tensor-parallel state. At world size 1 every collective is a no-op; the state is an object
handed to layers (no module-level globals), so two engines can live in one process."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        torch.distributed.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE = ParallelState()
