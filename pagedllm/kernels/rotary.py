"""Rotary position embedding in the rotate-half (GPT-NeoX / HF Llama) layout, applied to q and
k from a precomputed cos/sin cache indexed by position. The Triton version lives in
rotary_triton.py; `apply_rotary` uses it for CUDA tensors, and the C kernel of cpu_kernels.py
(the same bits as the torch path) for float32 on the CPU. All return new tensors and leave q
and k unchanged."""

from __future__ import annotations

import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels._triton import use_triton


def rotary_cos_sin(positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin at `positions` ([T, 1, D]): with sin's first half negated,
    rotate_half(x) * sin == swap_halves(x) * folded_sin exactly (-(a * b) == a * -b)."""
    cos = cos_cache[positions].unsqueeze(1).to(dtype)
    sin = sin_cache[positions].unsqueeze(1).to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_torch(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [max_pos, D] float32, cat(freqs, freqs).cos()
    sin_cache: torch.Tensor,  # [max_pos, D] float32
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,  # rotary_cos_sin(...), if known
) -> tuple[torch.Tensor, torch.Tensor]:
    # HF's q * cos + rotate_half(q) * sin, for q and k in one pass over their concatenation
    cos, sin = cos_sin if cos_sin is not None else rotary_cos_sin(positions, cos_cache, sin_cache, q.dtype)
    t, hq, d = q.shape
    qk = torch.cat((q, k), dim=1)  # [T, Hq + Hkv, D]
    swapped = qk.view(t, -1, 2, d // 2).flip(2).view(t, -1, d)  # the two halves exchanged
    out = qk * cos + swapped * sin
    return out[:, :hq], out[:, hq:]


def apply_rotary(positions, q, k, cos_cache, sin_cache, step_cache: dict | None = None):
    """step_cache: a dict that lives for one forward pass (ForwardBatch.step_cache); the torch
    path keeps the gathered cos/sin there, so the layers sharing these caches gather once."""
    if use_triton(q):
        from pagedllm.kernels.rotary_triton import apply_rotary_triton

        return apply_rotary_triton(positions, q, k, cos_cache, sin_cache)
    if q.device.type == "cpu":
        out = cpu_kernels.rotary(positions, q, k, cos_cache, sin_cache)
        if out is not None:
            return out
    cos_sin = None
    if step_cache is not None:
        key = ("rotary", cos_cache.data_ptr(), q.dtype)
        cos_sin = step_cache.get(key)
        if cos_sin is None:
            cos_sin = step_cache[key] = rotary_cos_sin(positions, cos_cache, sin_cache, q.dtype)
    return apply_rotary_torch(positions, q, k, cos_cache, sin_cache, cos_sin)
