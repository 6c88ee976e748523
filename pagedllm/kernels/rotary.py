"""Rotary position embedding in the rotate-half (GPT-NeoX / HF Llama) layout, applied to q and
k from a precomputed cos/sin cache indexed by position. The Triton version lives in
rotary_triton.py; `apply_rotary` uses it for CUDA tensors, and the C kernel of cpu_kernels.py
(the same bits as the torch path) for float32 on the CPU. All return new tensors and leave q
and k unchanged."""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels._triton import use_triton


def apply_rotary_torch(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [max_pos, D] float32, cat(freqs, freqs).cos()
    sin_cache: torch.Tensor,  # [max_pos, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    # HF's q * cos + rotate_half(q) * sin, for q and k in one pass over their concatenation;
    # with sin's first half negated, rotate_half(x) * sin == swap_halves(x) * sin' exactly
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    t, hq, d = q.shape
    sin = torch.cat((-sin[..., : d // 2], sin[..., d // 2 :]), dim=-1)
    qk = torch.cat((q, k), dim=1)  # [T, Hq + Hkv, D]
    swapped = qk.view(t, -1, 2, d // 2).flip(2).view(t, -1, d)  # the two halves exchanged
    out = qk * cos + swapped * sin
    return out[:, :hq], out[:, hq:]


def apply_rotary(positions, q, k, cos_cache, sin_cache):
    if use_triton(q):
        from pagedllm.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(positions, q, k, cos_cache, sin_cache)
    out = cpu_kernels.rotary(positions, q, k, cos_cache, sin_cache) if q.device.type == "cpu" else None
    return out if out is not None else apply_rotary_torch(positions, q, k, cos_cache, sin_cache)
