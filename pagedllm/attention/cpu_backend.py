"""The CPU attention backend: the torch backend with its decodes computed by the C kernel of
pagedllm/kernels/cpu_kernels.py, which reads K/V in place through the block tables; prefill
chunks keep the torch path (SDPA over the request's gathered context). Tensors the kernel does
not take (not float32) go the torch way too."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import ForwardBatch
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kernels import cpu_kernels


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
            scale: float) -> torch.Tensor:
    return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor):
        return _decode if cpu_kernels.supports(q, k_cache) else None
