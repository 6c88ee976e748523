"""Rotary embedding: inverse frequencies for the rope types we support (default, linear,
dynamic NTK, YaRN, LongRoPE, llama3), a float32 cos/sin cache over positions (scaled by YaRN's
and LongRoPE's attention factor), and application through pagedllm.kernels.rotary. Scaling
changes only the cache's contents, so the kernels and the CUDA-graph path are those of plain
rope."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.rotary import apply_rotary


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """rope_theta and scaling from a transformers config (v5 `rope_parameters` or v4
    `rope_theta` + `rope_scaling`); `layer_type` picks one entry of a per-layer-type dict
    (Gemma 3: "full_attention" / "sliding_attention", each with its own base)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is None or layer_type not in scaling:
        for k, v in scaling.items():
            if not isinstance(v, dict):
                params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    partial = getattr(hf_config, "partial_rotary_factor", None) or getattr(hf_config, "rotary_pct", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "su":  # the early name of longrope (Phi-3's first configs)
        rope_type = "longrope"
    params["rope_type"] = rope_type
    orig = getattr(hf_config, "original_max_position_embeddings", None)
    if orig is not None:
        params.setdefault("original_max_position_embeddings", orig)
    params["max_position_embeddings"] = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    # the engine's max_model_len (set by the loader), which picks LongRoPE's and dynamic NTK's
    # frequencies; without it, the longest length the config allows
    params["max_model_len"] = int(getattr(hf_config, "pagedllm_max_model_len", 0) or rope_max_positions(hf_config))
    return params


def rope_max_positions(hf_config: Any) -> int:
    """The longest sequence a config's rotary embedding is meant for, as vLLM derives it: its
    max_position_embeddings, times the factor of `linear` and `dynamic` scaling; for `yarn`
    the original context times the factor. LongRoPE and llama3 configs state the extended
    length as max_position_embeddings already."""
    length = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.update({k: v for k, v in (getattr(hf_config, "rope_scaling", None) or {}).items()})
    kind = params.get("rope_type") or params.get("type") or "default"
    factor = params.get("factor")
    if kind in ("linear", "dynamic") and factor:
        return int(length * float(factor))
    if kind == "yarn" and factor:
        orig = params.get("original_max_position_embeddings") or length
        return int(int(orig) * float(factor))
    return length


def _yarn_inv_freq(head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN: per-dimension blend of interpolated (inv / factor) and original frequencies, by
    a linear ramp between the dims that rotate beta_fast and beta_slow times over the original
    context; cos/sin scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    base = float(params["rope_theta"])
    orig = int(params.get("original_max_position_embeddings") or params["max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else params["max_position_embeddings"] / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def _longrope_inv_freq(head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dimension factors, `long_factor` when the engine serves past the
    original context (max_model_len > original_max_position_embeddings: vLLM's rule, one set
    for every token, so cached keys stay valid), `short_factor` otherwise; cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original)). HF picks the set per forward pass by the current
    length instead: the two agree on any sequence past the original context, and on every
    sequence when max_model_len stays within it."""
    base = float(params["rope_theta"])
    orig = int(params.get("original_max_position_embeddings") or params["max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else params["max_position_embeddings"] / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = params["long_factor"] if params["max_model_len"] > orig else params["short_factor"]
    ext = torch.tensor(ext, dtype=torch.float32)
    inv = 1.0 / (ext * base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv, float(attention_factor)


def _inv_freq(head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2], the factor cos and sin are scaled by)."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "dynamic":
        # NTK-aware base for the longest sequence served: HF recomputes it per forward from the
        # current length, which is the plain base up to max_position_embeddings; a paged cache
        # keeps keys rotated once, so one base is fixed, that of max_model_len (the plain one
        # while max_model_len stays within the original context)
        factor, max_pos = float(params["factor"]), params["max_position_embeddings"]
        seq_len = max(params["max_model_len"], max_pos)
        if seq_len > max_pos:
            base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
            inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, params)
    if kind == "longrope":
        return _longrope_inv_freq(head_dim, params)
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
        return torch.where(in_band, blended, scaled), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, dynamic, yarn, longrope, llama3)")


def rotary_dim_of(head_dim: int, params: dict) -> int:
    """How many dims of a head rotate (`partial_rotary_factor`, as transformers rounds it)."""
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor gives {rotary_dim} rotary dims of head_dim={head_dim}; need an even count")
    return rotary_dim


class RotaryEmbedding(nn.Module):
    """cos/sin caches of the full head width D in the rotate-half layout. A partial rotary
    (rotary_dim < D) gets cos 1 and sin 0 past its rotary_dim / 2 frequencies (the dims pass
    through exactly, unscaled by YaRN's or LongRoPE's attention factor), which needs q and k in
    the layout of `partial_rotary_permutation` (model/layers/partial_rotary.py): the model
    permutes their weight rows once at load."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv, attention_factor = _inv_freq(rotary_dim_of(head_dim, params), params)
        pos = torch.arange(max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]  # [max_pos, r/2]
        cos, sin = freqs.cos(), freqs.sin()
        if attention_factor != 1.0:  # YaRN / LongRoPE: the same product HF takes, in float32
            cos, sin = cos * attention_factor, sin * attention_factor
        # the pass-through dims of a partial rotary: cos 1, sin 0, never scaled (HF leaves
        # them out of the rotation and of the attention factor; Phi-4-mini has both)
        rest = head_dim // 2 - inv.shape[0]
        cos = torch.cat((cos, cos.new_ones(max_position, rest)), dim=-1)  # [max_pos, D/2]
        sin = torch.cat((sin, sin.new_zeros(max_position, rest)), dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [max_pos, D]
        self.register_buffer("cos_cache", cos, persistent=False)  # [max_pos, D] float32
        self.register_buffer("sin_cache", sin, persistent=False)

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

