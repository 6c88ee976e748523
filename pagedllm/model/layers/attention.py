"""The attention layer: holds its layer's paged K/V cache and calls the attention backend.
The runner binds caches and backend after it sized the cache (`bind_kv_cache`)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, ForwardBatch


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # scales of an FP8 cache (real K/V = stored * scale); 1.0: e4m3 holds K/V as they are
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]
        assert self.backend is not None and self.k_cache is not None, "KV cache not bound"
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, batch, self.scale,
                                 self.k_scale, self.v_scale)
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)


def bind_kv_cache(model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  backend: AttentionBackend) -> None:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(k_caches):
        raise RuntimeError(f"{len(layers)} attention layers but {len(k_caches)} caches")
    for layer, kc, vc in zip(layers, k_caches, v_caches):
        layer.k_cache, layer.v_cache, layer.backend = kc, vc, backend
