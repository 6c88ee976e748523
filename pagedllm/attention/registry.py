"""Picks an attention backend by name (the interface is in backend.py; each backend module
imports only that interface, and only this module knows them all)."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend

_FP8_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for CacheConfig.cache_dtype (auto: the model's dtype)."""
    return _FP8_CACHE_DTYPES.get(cache_dtype, model_dtype)


def get_attention_backend(name: str | None, device: str) -> AttentionBackend:
    """`name` None picks the default: triton on CUDA (when importable), cpu on the CPU (when its
    C kernel builds), torch otherwise."""
    if name is None:
        name = "torch"
        if device == "cpu":
            from pagedllm.kernels import cpu_kernels

            name = "cpu" if cpu_kernels.available() else "torch"
        elif device == "cuda":
            try:
                import triton  # noqa: F401

                from pagedllm.attention import triton_backend  # noqa: F401

                name = "triton"
            except ImportError:
                name = "torch"
    if name == "torch":
        from pagedllm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from pagedllm.attention.cpu_backend import CpuAttentionBackend
        from pagedllm.kernels import cpu_kernels

        if not cpu_kernels.available():
            raise ValueError(
                "attention_backend='cpu' needs its C kernel, which could not be built "
                "(see the log; a C compiler is required) or is turned off by PAGEDLLM_CPU_KERNELS=0"
            )
        return CpuAttentionBackend()
    raise ValueError(f"attention_backend must be torch, triton or cpu, got {name!r}")
