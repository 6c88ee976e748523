"""When to use the Triton kernels: a tensor on CUDA and an importable `triton`; which opt-in
fusions are on. Nothing here imports triton at module import, so `pagedllm.kernels` loads on a
CPU machine without it."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package can be found (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """The dispatchers' rule: Triton for CUDA tensors when triton is installed, torch otherwise."""
    return x.is_cuda and triton_available()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fusion_enabled(option: str, default: bool = True) -> bool:
    """Whether a fused kernel path is on, read when a layer is built: PAGEDLLM_FUSED_<option>=0
    turns it off, =1 on, unset: `default`. ROPE_KV: q/k norm + rotary + store-KV in one kernel
    (kernels/qkv_rope.py), on by default (it runs on CUDA tensors only; the CPU keeps the unfused
    chain). ROUTER: the MoE router's product, softmax and top-k in one launch for 1-16 tokens
    (kernels/small_m.py `route_small`), on by default."""
    value = os.environ.get(f"PAGEDLLM_FUSED_{option}", "").strip()
    return default if not value else value != "0"
