"""The attention block's elementwise work between the qkv projection and attention, as one op:
split the projection's output into q, k, v; RMSNorm each q and k head (Qwen3, optional);
rotate q and k (rotate-half rotary); write k and v into the paged cache (16-bit or FP8 with
scales); return q for attention. The torch reference is the unfused chain of the kernels it
replaces (rms_norm, apply_rotary, store_kv), so it must equal them; the Triton version lives
in qkv_rope_triton.py and must equal this.

    qkv row [ (Hq + 2 Hkv) * D ] = | q heads | k heads | v heads |
    q  -> [q_norm] -> rotary -> q_out [T, Hq, D]
    k  -> [k_norm] -> rotary -> [- k_offset] -> k_cache[slot]   (slot -1: not stored)
    v  ------------------------> v_cache[slot]

Only the GPU path fuses (`qkv_norm_rope_store`); the layers keep the unfused path elsewhere."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.kernels._triton import use_triton
from pagedllm.kernels.norm import rms_norm_torch
from pagedllm.kernels.rotary import apply_rotary_torch


def qkv_norm_rope_store_torch(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int64
    cos_cache: torch.Tensor,  # [max_pos, D] float32
    sin_cache: torch.Tensor,  # [max_pos, D] float32
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] (16-bit or FP8)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,  # [D]: RMSNorm of each q head (None: no norm)
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 1e-6,
    k_scale: float = 1.0,  # FP8 caches: stored = value / scale
    v_scale: float = 1.0,
    k_offset: torch.Tensor | None = None,  # [Hkv, D] float32: K stored as (k - offset) / scale
) -> torch.Tensor:  # q [T, Hq, D], normed and rotated
    from pagedllm.attention.torch_backend import store_kv_torch

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        assert k_norm_weight is not None
        q = rms_norm_torch(q, q_norm_weight, eps)
        k = rms_norm_torch(k, k_norm_weight, eps)
    q, k = apply_rotary_torch(positions, q, k, cos_cache, sin_cache)
    if k_offset is not None:  # (in float32: the stores scale it so)
        k = k.float() - k_offset
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


def qkv_norm_rope_store(qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
                        num_heads, num_kv_heads, head_dim, q_norm_weight=None, k_norm_weight=None,
                        eps=1e-6, k_scale=1.0, v_scale=1.0, k_offset=None):  # fmt: skip
    """The Triton kernel on CUDA, the reference elsewhere (same arguments as the reference)."""
    if use_triton(qkv):
        from pagedllm.kernels.qkv_rope_triton import qkv_norm_rope_store_triton

        return qkv_norm_rope_store_triton(qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
                                          num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                                          eps, k_scale, v_scale, k_offset=k_offset)  # fmt: skip
    return qkv_norm_rope_store_torch(qkv, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping,
                                     num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                                     eps, k_scale, v_scale, k_offset)  # fmt: skip


class DecodeRope(NamedTuple):
    """qkv_norm_rope_store's arguments for a step of decodes (request i's token at row i), which
    the decode kernel takes to do this work itself (kernels/attention_decode.py, `rope_decode_ok`)."""

    positions: torch.Tensor  # [B] int
    cos_cache: torch.Tensor  # [max_pos, D] float32
    sin_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [B] int64, -1 = not stored
    q_norm_weight: torch.Tensor | None  # [D] (None: no q/k norm)
    k_norm_weight: torch.Tensor | None
    eps: float
