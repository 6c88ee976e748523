"""vLLM spellings and values that pagedllm maps onto its own, each mapping logged once with its
reason: sizes written `10G` / `10GiB` / `512M`, vLLM's attention backend names, a KV block size
the paged kernels cannot use, and the flags that cannot apply on this device or under this
preemption mode. Pure Python (no torch); config.py calls it while building the EngineConfig.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger("pagedllm.config")

MAX_BLOCK_SIZE = 1024  # tokens; the kernels index a block with int32 offsets and tile it by 16..
_GiB = 1 << 30
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)

# vLLM's backend names -> pagedllm's (None: the device's default)
_ATTENTION_BACKENDS = {
    "FLASH_ATTN": "triton",
    "FLASH_ATTN_VLLM_V1": "triton",
    "TRITON_ATTN": "triton",
    "TRITON_ATTN_VLLM_V1": "triton",
    "FLASHINFER": "triton",
    "FLASHINFER_VLLM_V1": "triton",
    "XFORMERS": "triton",
    "FLEX_ATTENTION": "triton",
    "TORCH_SDPA": "torch",
    "TORCH_SDPA_VLLM_V1": "torch",
    "CPU_ATTN": "cpu",
}


def parse_size(value: int | float | str, name: str) -> int:
    """Bytes from an int or a string such as "4GiB", "10G", "512MB", "1.5g" (a unit is binary:
    G = GiB, as in vLLM's `--swap-space 10G` habit)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size in bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{name} must be a size in bytes or a string like '4GiB', got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    power = " kmgt".index(unit) if unit else 0
    return int(number * 1024**power)


def parse_gib_or_size(value: Any, name: str) -> float:
    """GiB from a number (vLLM's --swap-space 4) or a size string ("10G", "10GiB", "512M")."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of GiB or a size like '10G', got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)  # a bare number is GiB, as vLLM's flag
        except ValueError:
            return parse_size(text, name) / _GiB
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number of GiB >= 0 or a size like '10G', got {value!r}")
    return float(value)


def resolve_attention_backend(name: str | None) -> str | None:
    if name is None or name in ("torch", "triton", "cpu"):
        return name
    mapped = _ATTENTION_BACKENDS.get(str(name).upper())
    if mapped is None:
        raise ValueError(
            f"attention_backend must be torch, triton, cpu or one of vLLM's names "
            f"({', '.join(sorted(_ATTENTION_BACKENDS))}); got {name!r}"
        )
    logger.info("attention_backend=%s is vLLM's name; pagedllm runs its %s backend", name, mapped)
    return mapped


def resolve_block_size(value: Any, head_dim: int, elem_bytes: int) -> int:
    """A power of two up to MAX_BLOCK_SIZE tokens is used as given. A larger value cannot be a
    token count the kernels tile (and no real engine uses one): it is read as bytes, the size of
    one block of one layer's K (or V) for one KV head, which is what block-size figures in bytes
    usually describe (4096 bytes = 16 tokens of a 128-dim half-precision head, vLLM's default),
    and mapped to that many tokens, logged."""
    from pagedllm.config_build import _check_int

    block = _check_int("block_size", value, 1)
    if block <= MAX_BLOCK_SIZE:
        if block & (block - 1):
            raise ValueError(f"block_size must be a power of two, got {block}")
        return block
    per_token = head_dim * elem_bytes
    tokens = max(1, min(MAX_BLOCK_SIZE, block // per_token))
    tokens = 1 << (tokens.bit_length() - 1)  # a power of two, rounded down
    logger.info(
        "block_size=%d is more tokens than the paged kernels use (at most %d); read as bytes per block of "
        "one KV head (head_dim %d x %d bytes = %d bytes/token): %d tokens per block",
        block,
        MAX_BLOCK_SIZE,
        head_dim,
        elem_bytes,
        per_token,
        tokens,
    )
    return tokens


def log_inapplicable(args: Any, device: str, preemption_mode: str, swap_gib: float) -> list[str]:
    """One line for each flag that was set but cannot apply here."""
    lines = []
    if device == "cpu" and args.gpu_memory_utilization != 0.9:
        lines.append(
            f"gpu_memory_utilization={args.gpu_memory_utilization} does not apply on a CPU: the KV cache "
            "takes kv_cache_memory (default: a quarter of free RAM, at most 4 GiB)"
        )
    if preemption_mode != "swap" and swap_gib != 4.0:
        lines.append(
            f"swap_space={swap_gib:g} GiB is not used: preemption is by recompute (preemption_mode='swap' "
            "swaps KV blocks to that much CPU memory)"
        )
    for line in lines:
        logger.info("%s", line)
    return lines
