"""The CPU attention backend: the torch backend with its decodes computed by the C kernel of
pagedllm/kernels/cpu_kernels.py, which reads K/V in place through the block tables; prefill
chunks keep the torch path (SDPA over the request's gathered context). Tensors the kernel does
not take (not float32) go the torch way too. A sliding window and a logit soft cap (per layer)
go to the C kernel as well."""

from __future__ import annotations

import functools

import torch

from pagedllm.attention.backend import ForwardBatch
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.kernels import cpu_kernels


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
            scale: float, sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                              sliding_window, logits_soft_cap)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None):
        if not cpu_kernels.supports(q, k_cache):
            return None
        if sliding_window is None and logits_soft_cap is None:
            return _decode
        return functools.partial(_decode, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
