"""When to use the Triton kernels: a tensor on CUDA and an importable `triton`. Nothing here
imports triton at module import, so `pagedllm.kernels` loads on a CPU machine without it."""

from __future__ import annotations

import functools
import importlib.util

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
