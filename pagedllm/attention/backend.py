"""The attention backend interface and the one object it reads: `ForwardBatch`.

A backend owns two things for one layer call: writing the new K/V of every scheduled token
into the paged cache (through `slot_mapping`), and attending each request's queries to its
whole context (cached prefix + the new tokens) through its block table. It never allocates
blocks and never looks at requests; the runner builds `ForwardBatch` once per step.

Paged KV layout, per layer (K and V alike, as the tensors index):

    cache[num_blocks, block_size, num_kv_heads, head_dim]
    request r, token position p  ->  block_tables[r, p // block_size], offset p % block_size
    slot = block_id * block_size + offset   (cache.view(-1, H, D)[slot] when contiguous)

In memory, the V blocks of FP8 caches are stored [num_kv_heads, head_dim, block_size] (a head's
keys fastest; `v_blocks_transposed`): the V cache is then a strided view with the same indexing
(`v_cache_view`). The product P V reduces over keys, and a tensor core's operand wants the
reduced dimension contiguous; 16-bit values get transposed on the way from shared memory
(ldmatrix.trans) but FP8 ones cannot, so the attention kernels read FP8 V blocks key-major.

Requests in a batch are ordered decodes first (query_len == 1), then prefill chunks:

    tokens:  | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |        query_start_loc = [0,1,2,3,7,9]
             '--- num_decodes = 3 ---'
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagedllm.kernels.qkv_rope import DecodeRope

def v_blocks_transposed(cache_dtype: torch.dtype) -> bool:
    """Whether the V cache's blocks are stored [Hkv, D, block_size]: FP8 caches. To compare the
    layouts on a GPU, PAGEDLLM_V_TRANSPOSED=1 makes 16-bit caches key-major too and =0 keeps FP8
    ones head_dim-major (float32 never changes: the CPU backend's C kernel reads it contiguous)."""
    switch = os.environ.get("PAGEDLLM_V_TRANSPOSED", "").strip()
    if switch == "0":
        return False
    return cache_dtype.itemsize == 1 or (switch == "1" and cache_dtype.itemsize == 2)


def v_cache_view(v: torch.Tensor) -> torch.Tensor:
    """The V cache of a contiguous [N, bs, Hkv, D] tensor: itself, or for FP8 its blocks stored
    key-major (`key_major_view`)."""
    return key_major_view(v) if v_blocks_transposed(v.dtype) else v


def key_major_view(v: torch.Tensor) -> torch.Tensor:
    """A contiguous [N, bs, Hkv, D] tensor's memory read as blocks [Hkv, D, bs], viewed back as
    [N, bs, Hkv, D] (strides: 1 along bs, bs along D)."""
    n, bs, h, d = v.shape
    return v.view(n, h, d, bs).permute(0, 3, 1, 2)


class AttentionMetadata:
    """A backend's per-step view of a ForwardBatch (gather indices, masks, flags), built once
    by its `build_metadata`; each backend that needs one subclasses this."""

    __slots__ = ()


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, all scheduled tokens, requests concatenated
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token; -1 = do not store (padding)
    query_start_loc: torch.Tensor  # [B+1] int32, start of each request's tokens in input_ids
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    logits_indices: torch.Tensor  # [S] int64, rows of the hidden states that need logits
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # [B] host copy
    seq_lens_cpu: list[int]  # [B] host copy
    # what the backend derives from the batch once per step (`build_metadata`, called by the
    # runner before the model runs) and every layer reads; the runner never reads it
    attn_metadata: AttentionMetadata | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache, then attends. Implementations must agree with
    `TorchAttentionBackend` (the reference) on any mix of decodes and prefill chunks over a
    cached prefix, with GQA (num_q_heads a multiple of num_kv_heads)."""

    name: str = "abstract"
    # True: `attend` runs a layer's attention over the cache alone, the step's K/V stored into
    # it already (by a kernel that fuses the store into the work before attention)
    attends_stored_kv: bool = False

    def build_metadata(self, batch: ForwardBatch, block_size: int) -> AttentionMetadata | None:
        """What every layer's `forward` of this step reads, derived once (None: nothing)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,  # FP8 caches: real K/V = stored value * scale
        v_scale: float = 1.0,
        sliding_window: int | None = None,  # the query at p sees keys p - W + 1 .. p only
        logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap) before softmax
    ) -> torch.Tensor:  # [T, Hq, D]
        ...

    def attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], this step's K/V stored already
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """`forward` without its store (only where `attends_stored_kv`)."""
        raise NotImplementedError(f"the {self.name} attention backend stores K/V itself: call forward")

    def attend_decodes_qkv(self, qkv: torch.Tensor, rope: DecodeRope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           batch: ForwardBatch, scale: float, sliding_window: int | None = None,
                           logits_soft_cap: float | None = None) -> torch.Tensor | None:  # fmt: skip
        """A step of decodes only, from the qkv projection's rows [T, (Hq + 2 Hkv) * D]: the q/k
        norm, the rotary and the K/V store done inside the attention (`rope`: their inputs)
        -> [T, Hq, D]; None where this backend cannot (the
        caller then stores and attends in two steps)."""
        return None
