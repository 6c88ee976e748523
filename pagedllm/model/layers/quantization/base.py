"""The quantized-linear interface: a `QuantizationConfig` (what a checkpoint or the user asked
for) hands each linear layer a `LinearMethod`, which owns that layer's weight layout (the
parameters it creates, with their weight loaders, so a rank loads only its shard),
`process_weights_after_loading` (repacking, online quantization) and `apply` (its kernels).

Layers are chosen at load, not in the model code: `quantize_model` walks a built model and gives
every column- and row-parallel linear the method its config picks (None keeps it unquantized:
an ignored layer). Models know nothing of quantization; the embedding and LM head stay in the
model's dtype unless the config gives them a method too (GGUF; FP8's online quantization for
an untied LM head). Any format (fp8.py, gguf.py,
wna16.py for GPTQ / AWQ / compressed-tensors integer weights) is one config class and one method
class in this package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    """One layer's quantized weights and their product. Methods hold no tensors themselves:
    everything lives on the layer as parameters (so `.to()`, `named_parameters` and the
    loader's completeness check see it)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replaces / adds the layer's parameters before the checkpoint is read."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every weight was loaded (or drawn at random)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in_per_rank] -> [T, out_per_rank] (before any all-reduce)."""

    def takes_fp8_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply` would quantize activations like x per token to FP8 (W8A8), and so takes
        them as kernels/fp8.Fp8Rows already quantized; no method but FP8's does."""
        return False

    def describe(self) -> str:
        return type(self).__name__


class QuantizationConfig(ABC):
    """A quantization format, built from `quantization=` and/or the checkpoint's
    `quantization_config`. Must be picklable (it travels to tensor-parallel workers)."""

    name: str = "abstract"

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the linear layer named `prefix` (None: leave it unquantized)."""

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for an embedding or LM head (None, the default: the model's dtype)."""
        return None

    def describe(self) -> str:
        """One line for the startup plan and /metrics, e.g. 'fp8 e4m3 per-channel (online)'."""
        return self.name


def _is_ignored(prefix: str, ignored: tuple[str, ...]) -> bool:
    """vLLM's rule: a module is ignored when an entry names it or a module above it; entries
    starting 're:' are regular expressions. Checkpoints name the separate q/k/v and gate/up
    projections, so a fused layer is ignored when any of its parts is."""
    import re

    parts = {prefix}
    for fused, split in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if prefix.endswith(fused):
            parts.update(prefix[: -len(fused)] + s for s in split)
    for entry in ignored:
        for p in parts:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], p):
                    return True
            elif p == entry or p.startswith(entry + ".") or p.endswith("." + entry):
                return True
    return False


def quantize_model(model: nn.Module, config: QuantizationConfig) -> int:
    """Gives each parallel linear of `model` its method and lets it create its parameters.
    Returns the number of layers quantized."""
    from pagedllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear

    from pagedllm.model.layers.embedding import VocabParallelEmbedding

    count = 0
    owners: dict[int, LinearMethod | None] = {}  # id of a (tied) vocabulary weight -> its method
    for prefix, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            if id(module.weight) in owners:  # a tied LM head: the embedding's weight and method
                owner = owners[id(module.weight)]
                if owner is not None:
                    owner.tie(module)
                continue
            method = config.get_embedding_method(module, prefix)
            owners[id(module.weight)] = method
        elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            method = config.get_linear_method(module, prefix)
        else:
            continue
        if method is None:
            continue
        module.quant_method = method
        method.create_weights(module)
        count += 1
    return count


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
