"""Rotary embedding: inverse frequencies for the rope types we support (default, linear,
llama3), a float32 cos/sin cache over positions, and application through
pagedllm.kernels.rotary."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.rotary import apply_rotary


def rope_parameters(hf_config: Any) -> dict:
    """rope_theta and scaling from a transformers config (v5 `rope_parameters` or v4
    `rope_theta` + `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def _inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        lo, hi = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv = _inv_freq(head_dim, params)
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]  # [max_pos, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)  # [max_pos, D] float32
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary(positions, q, k, self.cos_cache, self.sin_cache)


# live rotary embeddings by (head_dim, max_position, params, device): the layers of a model
# share one, as its cos/sin caches are the same for all (Llama-3.1's 131,072 positions take
# 67 MB per cache and layer otherwise); an entry goes when its model does
_shared: "weakref.WeakValueDictionary[tuple, RotaryEmbedding]" = weakref.WeakValueDictionary()


def get_rotary_embedding(head_dim: int, max_position: int, params: dict) -> RotaryEmbedding:
    """A RotaryEmbedding on the current default device, shared with any live one of the same
    parameters."""
    key = (head_dim, max_position, repr(sorted(params.items())), str(torch.get_default_device()))
    rope = _shared.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_dim, max_position, params)
        _shared[key] = rope
    return rope
