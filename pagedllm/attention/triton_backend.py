"""Triton attention backend (CUDA): stores the step's K/V with the store-KV kernel (or, through
`attend`, finds them stored by the layer's fused norm/rotary/store kernel), then runs
the decodes (the first `num_decodes` requests, one token each) through the split-K paged decode
kernel and the prefill chunks through the varlen paged FlashAttention kernel. Must equal
`TorchAttentionBackend`.

It never synchronises with the host: grid sizes come from `ForwardBatch`'s host lists and
`max_seq_len`, and per-request lengths are read on the device. A pure-decode batch launches a
grid fixed by (num_decodes, max_seq_len), so it can be captured in a CUDA graph when the runner
passes the same upper bound `max_seq_len` at capture and at replay.
"""

from __future__ import annotations

import os

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, ForwardBatch
from pagedllm.kernels.attention import prefill_attention_triton, store_kv_triton
from pagedllm.kernels.attention_decode import decode_attention_triton, rope_decode_ok
from pagedllm.kernels.qkv_rope import DecodeRope


class TritonMetadata(AttentionMetadata):
    """The step's decodes by descending context length (int32 [num_decodes]), sorted once on the
    device for all layers: the decode kernel's programs take the longest first, so that the grid's
    tail is short work. On by default (H200, RESULTS.md: the bf16 kernel at W1's mixed lengths
    311.5 -> 279.4 us and W1 1.044x alternated, eleventh session; the FP8 kernel, V blocks
    key-major, 221.0 -> 201.2 us and W1 with an FP8 cache 1.049x, fourteenth session);
    PAGEDLLM_DECODE_ORDER=0 turns it off."""

    __slots__ = ("decode_order",)

    def __init__(self, decode_order: torch.Tensor):
        self.decode_order = decode_order


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    attends_stored_kv = True

    def __init__(self) -> None:
        self.order_decodes = os.environ.get("PAGEDLLM_DECODE_ORDER", "1").strip() != "0"

    def build_metadata(self, batch: ForwardBatch, block_size: int) -> AttentionMetadata | None:
        nd = batch.num_decodes
        if not self.order_decodes or nd < 2:
            return None
        order = torch.argsort(batch.seq_lens[:nd], descending=True).to(torch.int32)
        return TritonMetadata(order)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,  # the cache's scales (FP8 caches): real K/V = stored * scale
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        store_kv_triton(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale, sliding_window, logits_soft_cap)

    def attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], the step's K/V stored already
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = batch.num_decodes
        num_reqs = batch.num_reqs
        if nd > 0:
            decode_attention_triton(
                q[:nd], k_cache, v_cache, batch.block_tables, batch.seq_lens, out[:nd], scale,
                max_seq_len=batch.max_seq_len, k_scale=k_scale, v_scale=v_scale,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, order=_decode_order(batch),
            )  # fmt: skip
        if num_reqs > nd:
            max_query_len = max(batch.query_lens_cpu[nd:])
            prefill_attention_triton(
                q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, out, scale,
                first_req=nd, num_reqs=num_reqs - nd, max_query_len=max_query_len,
                k_scale=k_scale, v_scale=v_scale,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            )  # fmt: skip
        return out

    def attend_decodes_qkv(self, qkv: torch.Tensor, rope: DecodeRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           batch: ForwardBatch, scale: float, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor | None:  # fmt: skip
        """The decode kernel from the qkv rows (qkv_rope.DecodeRope: qkv_rope's kernel does
        not run), where `rope_decode_ok` holds."""
        t = qkv.shape[0]
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        if not rope_decode_ok(qkv, k_cache, v_cache):
            return None
        hq = qkv.shape[1] // d - 2 * hkv
        out = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
        return decode_attention_triton(
            qkv[:, : hq * d].view(t, hq, d), k_cache, v_cache, batch.block_tables, batch.seq_lens, out, scale,
            max_seq_len=batch.max_seq_len, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            order=_decode_order(batch), rope=rope,
        )  # fmt: skip


def _decode_order(batch: ForwardBatch) -> torch.Tensor | None:
    """The step's decodes longest first (TritonMetadata), or None."""
    meta = batch.attn_metadata
    return meta.decode_order if isinstance(meta, TritonMetadata) else None
