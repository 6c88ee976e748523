"""What a model needs to know about pipeline stages: which of its layers it owns.

A stage builds only its own decoder layers; the others are `PPMissingLayer` placeholders
without parameters, so checkpoint names (`model.layers.{i}.…`) keep their indices and the
weights of other stages are skipped at load. The embedding lives on the first stage; the final
norm and the LM head on the last. What travels between stages (hidden states and residual) is
the executor's business (worker/model_runner.py), not the model's.
"""

from __future__ import annotations

import re
from typing import Callable

from torch import nn

from pagedllm.distributed import ParallelState

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class PPMissingLayer(nn.Identity):
    """A layer another pipeline stage owns: no parameters, never called."""


def make_layers(num_layers: int, ps: ParallelState, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    return nn.ModuleList([build(i) if ps.owns_layer(i) else PPMissingLayer() for i in range(num_layers)])


def owned_layers(layers: nn.ModuleList, ps: ParallelState) -> list[nn.Module]:
    start, end = ps.layer_range if ps.layer_range is not None else (0, len(layers))
    return list(layers[start:end])


def belongs_elsewhere(name: str, ps: ParallelState) -> bool:
    """True for a checkpoint tensor that another stage loads (a layer outside this stage's
    range; the embedding off the first stage; the final norm and LM head off the last)."""
    if ps.pp_size == 1:
        return False
    m = _LAYER_RE.search(name)
    if m is not None:
        return not ps.owns_layer(int(m.group(1)))
    if "embed_tokens" in name:
        return not ps.is_first_stage
    if name.startswith(("model.norm.", "lm_head.")):
        return not ps.is_last_stage
    return False
