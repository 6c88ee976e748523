"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder, whose checkpoint stores q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj` (row blocks [q | k | v] and [gate | up]). Each
fused tensor is cut into its row blocks, lazily, and each block goes through the fused layer's
own loader, so tensor parallelism takes its heads and columns as for Llama. LongRoPE
(`rope_scaling.type` "longrope" / "su") and the config's `sliding_window` come from the shared
layers (rotary.py, LlamaModel)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.layers.linear import materialize
from pagedllm.model.layers.rotary import rope_parameters
from pagedllm.model.models.llama import LlamaForCausalLM


class RowBlock:
    """Rows [start, start + length) of a checkpoint tensor or lazy slice, used like one
    (`.shape`, `.narrow`, `.load`) without reading the rest."""

    __slots__ = ("_src", "_start", "shape")

    def __init__(self, src, start: int, length: int):
        self._src, self._start = src, start
        self.shape = torch.Size([length, *src.shape[1:]])

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            if start < 0 or start + length > self.shape[0]:
                raise ValueError(f"rows [{start}, {start + length}) outside a block of {self.shape[0]}")
            return self._src.narrow(0, self._start + start, length)
        return self._src.narrow(0, self._start, self.shape[0]).narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return materialize(self._src).narrow(0, self._start, self.shape[0])


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        factor = rope_parameters(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if float(factor or 1.0) != 1.0:
            raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor={factor} (rotary over part of each head, "
                             "as in Phi-4-mini) is not supported")
        super().__init__(cfg, ps)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        q_rows, kv_rows = cfg.num_attention_heads * hd, kv * hd
        # fused checkpoint tensor -> (its row blocks, the shard id each block loads as)
        self._fused = {
            "qkv_proj": [(0, q_rows, "q"), (q_rows, kv_rows, "k"), (q_rows + kv_rows, kv_rows, "v")],
            "gate_up_proj": [(0, cfg.intermediate_size, 0), (cfg.intermediate_size, cfg.intermediate_size, 1)],
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()

        def unfused():
            # fused tensors are loaded here, in checkpoint order (a lazy slice is valid only
            # until the iterator moves on); the rest go to Llama's loader
            for name, tensor in weights:
                fused = next((f for f in self._fused if f".{f}." in name), None)
                if fused is None:
                    yield name, tensor
                    continue
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name} matches no parameter of {type(self).__name__}")
                blocks = self._fused[fused]
                total = sum(n for _, n, _ in blocks)
                if tensor.shape[0] != total:
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, the config gives {total}")
                p = params[name]
                for start, length, shard in blocks:
                    p.weight_loader(p, RowBlock(tensor, start, length), shard)
                loaded.add(name)

        return super().load_weights(unfused()) | loaded
