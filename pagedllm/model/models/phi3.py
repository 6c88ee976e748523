"""Phi-3 (`Phi3ForCausalLM`, also Phi-3.5 and Phi-4-mini): the Llama decoder, whose checkpoint
stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (row blocks [q | k | v] and
[gate | up]). Each fused tensor is cut into its row blocks, lazily, and each block goes through
Llama's loader under its unfused name, so tensor parallelism takes its heads and columns as for
Llama and a partial rotary (`partial_rotary_factor`, Phi-4-mini) permutes q and k as for
GPT-NeoX. LongRoPE (`rope_scaling.type` "longrope" / "su") and the config's `sliding_window`
come from the shared layers (rotary.py, LlamaModel)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.layers.linear import materialize
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
        super().__init__(cfg, ps)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        q_rows, kv_rows = cfg.num_attention_heads * hd, kv * hd
        # fused checkpoint tensor -> the unfused names of its row blocks: (name, first row, rows)
        self._fused = {
            "qkv_proj": [("q_proj", 0, q_rows), ("k_proj", q_rows, kv_rows), ("v_proj", q_rows + kv_rows, kv_rows)],
            "gate_up_proj": [("gate_proj", 0, cfg.intermediate_size),
                             ("up_proj", cfg.intermediate_size, cfg.intermediate_size)],
        }

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Each fused tensor as its row blocks under Llama's names, so Llama's loader stacks them
        and permutes q / k for a partial rotary (Phi-4-mini's partial_rotary_factor 0.75). The
        blocks are lazy views of one checkpoint slice, read before the iterator moves on."""
        for name, tensor in weights:
            fused = next((f for f in self._fused if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            blocks = self._fused[fused]
            total = sum(n for _, _, n in blocks)
            if tensor.shape[0] != total:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, the config gives {total}")
            for part, start, length in blocks:
                # GGUF blocks (`permute_rows`) cut whole rows without dequantizing
                gguf_blocks = hasattr(tensor, "permute_rows")
                block = tensor.narrow(0, start, length) if gguf_blocks else RowBlock(tensor, start, length)
                yield name.replace(f".{fused}.", f".{part}."), block
