"""Pipeline stages: which contiguous layers each stage owns, and how ranks are numbered.

The layers split into `pipeline_parallel_size` contiguous stages. By default every stage gets
num_layers // pp layers and the remainder goes, one each, to the stages just before the last
(the last stage also runs the final norm, the LM head and sampling, so it is kept light):

    32 layers, pp 3 -> 11 | 11 | 10          10 layers, pp 4 -> 2 | 3 | 3 | 2

$PAGEDLLM_PP_LAYER_PARTITION (or vLLM's $VLLM_PP_LAYER_PARTITION), a comma-separated list of
layer counts, one per stage, overrides the split: "5,3" gives the first stage 5 layers.

Ranks of one engine are numbered `pp_rank * tp_size + tp_rank`: stage s is the tensor-parallel
group of ranks [s * tp, (s + 1) * tp). Rank r of a stage sends its hidden states and residual
to rank r of the next stage (after the all-reduce every rank of a stage holds them whole).
This module imports no torch.
"""

from __future__ import annotations

import os

PARTITION_ENV_VARS = ("PAGEDLLM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")


def default_layer_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    parts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        parts[-2 - i if pp > 1 else 0] += 1
    return tuple(parts)


def resolve_layer_partition(num_layers: int, pp: int, env: dict[str, str] | None = None) -> tuple[int, ...]:
    """Layers per stage (() at pp 1). Raises ValueError naming the setting when the split
    cannot be made: more stages than layers, or an override that does not fit the model."""
    if pp == 1:
        return ()
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is larger than the model's num_hidden_layers={num_layers}"
        )
    env = os.environ if env is None else env
    for name in PARTITION_ENV_VARS:
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            parts = tuple(int(x) for x in raw.split(","))
        except ValueError:
            raise ValueError(f"{name}={raw!r} must be a comma-separated list of layer counts") from None
        if len(parts) != pp:
            raise ValueError(f"{name}={raw!r} has {len(parts)} entries; pipeline_parallel_size is {pp}")
        if any(p < 1 for p in parts):
            raise ValueError(f"{name}={raw!r}: every stage needs at least one layer")
        if sum(parts) != num_layers:
            raise ValueError(f"{name}={raw!r} sums to {sum(parts)}; the model has {num_layers} layers")
        return parts
    return default_layer_partition(num_layers, pp)


def stage_layers(partition: tuple[int, ...], pp_rank: int, num_layers: int) -> tuple[int, int]:
    """[start, end) of the layers stage pp_rank owns (all layers without a partition)."""
    if not partition:
        return 0, num_layers
    start = sum(partition[:pp_rank])
    return start, start + partition[pp_rank]


def rank_coords(rank: int, tp_size: int) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a global rank."""
    return divmod(rank, tp_size)


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose sampled tokens the engine reads: tensor rank 0 of the last stage."""
    return (pp_size - 1) * tp_size
