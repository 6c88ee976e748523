"""Rotary position embedding in the rotate-half (GPT-NeoX / HF Llama) layout, applied to q and
k from a precomputed cos/sin cache indexed by position. The Triton version lives in
rotary_triton.py; `apply_rotary` uses it for CUDA tensors. Both return new tensors and leave
q and k unchanged."""

from __future__ import annotations

import torch

from pagedllm.kernels._triton import use_triton


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_torch(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [max_pos, D] float32, cat(freqs, freqs).cos()
    sin_cache: torch.Tensor,  # [max_pos, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    q_out = q * cos + _rotate_half(q) * sin
    k_out = k * cos + _rotate_half(k) * sin
    return q_out, k_out


def apply_rotary(positions, q, k, cos_cache, sin_cache):
    if use_triton(q):
        from pagedllm.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(positions, q, k, cos_cache, sin_cache)
    return apply_rotary_torch(positions, q, k, cos_cache, sin_cache)
