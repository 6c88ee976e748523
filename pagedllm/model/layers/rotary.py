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
    partial = getattr(hf_config, "partial_rotary_factor", None) or getattr(hf_config, "rotary_pct", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
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


def rotary_dim_of(head_dim: int, params: dict) -> int:
    """How many dims of a head rotate (`partial_rotary_factor`, as transformers rounds it)."""
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor gives {rotary_dim} rotary dims of head_dim={head_dim}; need an even count")
    return rotary_dim


class RotaryEmbedding(nn.Module):
    """cos/sin caches of the full head width D in the rotate-half layout. A partial rotary
    (rotary_dim < D) gets frequency 0 (cos 1, sin 0: the dims pass through exactly) past its
    rotary_dim / 2 frequencies, which needs q and k in the layout of `partial_rotary_permutation`
    (model/layers/partial_rotary.py): the model permutes their weight rows once at load."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv = _inv_freq(rotary_dim_of(head_dim, params), params)
        inv = torch.cat((inv, inv.new_zeros(head_dim // 2 - inv.shape[0])))  # [D/2]
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
