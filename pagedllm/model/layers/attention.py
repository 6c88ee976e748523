"""The attention layer: holds its layer's paged K/V cache and calls the attention backend.
The runner binds caches and backend after it sized the cache (`bind_kv_cache`).
`layer_sliding_window` reads a config's sliding window for one layer."""

from __future__ import annotations

import torch
from torch import nn

from typing import Any

from pagedllm.attention.backend import AttentionBackend, ForwardBatch, v_cache_view
from pagedllm.kernels._triton import fusion_enabled
from pagedllm.kernels.qkv_rope import DecodeRope, qkv_norm_rope_store


def layer_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx` as transformers applies it: with `layer_types`
    (Qwen2, Gemma 2/3) only "sliding_attention" layers have one; without (Mistral, Phi-3,
    Starcoder2) `sliding_window` holds for every layer. None: full attention.

    A request keeps every KV block until it ends, also those that fell out of the windows of
    all layers (Mistral, StarCoder2, Phi-3): the kernels skip them, the block manager does not
    free them yet (a hole in a block table would reach swap, prefix caching and preemption)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[layer_idx] != "sliding_attention":
        return None
    return int(window)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # scales of an FP8 cache (real K/V = stored * scale); 1.0: e4m3 holds K/V as they are
        self.k_scale = 1.0
        self.v_scale = 1.0
        # an FP8 cache may store K less a per-channel offset [Hkv, D] float32 (worker/kv_offset.py):
        # every key of a query then loses the same vector, every score the same q . c, and the
        # softmax is unchanged, while e4m3 rounds |k - c| instead of |k|. None: K stored as it is
        self.k_offset: torch.Tensor | None = None
        self.k_stats: list | None = None  # while calibrating: [sum of the stored K [Hkv, D] float64, tokens]
        # per-layer options the backend honours (None: plain causal attention over all keys)
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.rope_in_decode = fusion_enabled("ROPE_DECODE")  # forward_qkv

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]
        assert self.backend is not None and self.k_cache is not None, "KV cache not bound"
        if self.k_stats is not None:
            self.k_stats[0] = self.k_stats[0] + k.double().sum(0)
            self.k_stats[1] += k.shape[0]
        elif self.k_offset is not None:
            k = (k.float() - self.k_offset).to(k.dtype)
        if self.sliding_window is None and self.logits_soft_cap is None:
            o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, batch, self.scale,
                                     self.k_scale, self.v_scale)
        else:
            o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, batch, self.scale,
                                     self.k_scale, self.v_scale,
                                     sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)

    def can_store_qkv(self, qkv: torch.Tensor) -> bool:
        """Whether `forward_qkv` may run: a CUDA tensor and a backend that attends K/V stored by
        someone else."""
        return qkv.is_cuda and self.backend is not None and self.backend.attends_stored_kv and self.k_stats is None

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                    eps: float, batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
        """`forward` from the qkv projection's output [T, (Hq + 2 Hkv) * D]: one kernel norms
        (optionally) and rotates q and k and stores k and v; the backend then attends from the
        cache. A step of decodes only (unless PAGEDLLM_FUSED_ROPE_DECODE=0) goes to the backend's
        `attend_decodes_qkv` first, which does all of it in the attention kernel (16-bit or
        float32 caches without scales or a K offset). -> [T, Hq * D]"""
        assert self.backend is not None and self.k_cache is not None and self.v_cache is not None
        if (self.rope_in_decode and batch.num_decodes == batch.num_reqs == batch.num_tokens
                and self.k_offset is None and self.k_scale == self.v_scale == 1.0):  # fmt: skip
            rope = DecodeRope(positions, cos_cache, sin_cache, batch.slot_mapping, q_norm_weight, k_norm_weight, eps)
            o = self.backend.attend_decodes_qkv(qkv, rope, self.k_cache, self.v_cache, batch, self.scale,
                                                self.sliding_window, self.logits_soft_cap)  # fmt: skip
            if o is not None:
                return o.reshape(o.shape[0], self.num_heads * self.head_dim)
        q = qkv_norm_rope_store(qkv, positions, cos_cache, sin_cache, self.k_cache, self.v_cache, batch.slot_mapping,
                                self.num_heads, self.num_kv_heads, self.head_dim, q_norm_weight, k_norm_weight,
                                eps, self.k_scale, self.v_scale, self.k_offset)  # fmt: skip
        o = self.backend.attend(q, self.k_cache, self.v_cache, batch, self.scale, self.k_scale, self.v_scale,
                                self.sliding_window, self.logits_soft_cap)  # fmt: skip
        return o.reshape(o.shape[0], self.num_heads * self.head_dim)


def bind_kv_cache(model: nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  backend: AttentionBackend) -> None:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(k_caches):
        raise RuntimeError(f"{len(layers)} attention layers but {len(k_caches)} caches")
    for layer, kc, vc in zip(layers, k_caches, v_caches):
        # FP8 V blocks are stored key-major (attention/backend.py): a view with the same indexing
        layer.k_cache, layer.v_cache, layer.backend = kc, v_cache_view(vc), backend
