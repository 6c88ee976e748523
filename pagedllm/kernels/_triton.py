"""When to use the Triton kernels: a tensor on CUDA and an importable `triton`; which opt-in
fusions are on; which kernels were compiled. Nothing here imports triton at module import, so
`pagedllm.kernels` loads on a CPU machine without it."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def recorded_compiles():
    """Yields the list of the Triton kernels this process compiles while inside (each the name
    with its argument specialisation, from Triton's JIT cache hook), or None without triton. A
    kernel compiled on the serving path (a specialisation no warm-up reached) stalls its step
    for 30-100 ms."""
    try:
        from triton import knobs

        old = knobs.runtime.jit_cache_hook
    except (ImportError, AttributeError):  # no triton, or one older than its knobs (3.4)
        yield None
        return
    seen: list[str] = []

    def hook(**kwargs) -> bool:
        seen.append(str(kwargs.get("repr", "?")))
        return False  # True would skip the compile

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = old
