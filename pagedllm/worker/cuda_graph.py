"""CUDA graphs for decode steps.

A pure-decode step (every request has one query token) is replayed from a graph captured at
startup for the next batch size up in a ladder (1, 2, 4, 8, then steps of 8 up to the cap),
largest first so all graphs share one memory pool. The graphs read the runner's StepBuffers
(worker/input_batch.py): the runner lays out a decode step padded to the graph's batch size
there, so replaying copies nothing; padding rows get slot -1 (nothing stored) and seq_len 0
(the decode kernel writes zeros).
The attention grid depends only on the batch size and the `max_seq_len` bound, which is
`max_model_len` at capture and at replay -- and, with PAGEDLLM_GRAPH_CONTEXT_BUCKETS (on by default,
=0 off, or a list of bounds: context_buckets(); Qwen3-30B-A3B batch 1 on an H100 3.246 -> 3.195 ms/token,
three rounds alternated), the smaller bounds (CONTEXT_BUCKETS by default) for the batch sizes
whose decode split count they change: a step replays the graph of the least bound at least its
longest context. The decode kernel cuts each request's actual length into the grid's splits, so
any bound is correct; a small one only spares short contexts the splits (and the reduce kernel)
that a long max_model_len asks for at small batches (Qwen3-30B-A3B batch 1, max_model_len 4,096:
32 splits and a reduce kernel a layer for a few hundred tokens; at a bound of 1,024, 8 splits
merged by the last one).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch

from pagedllm.attention.backend import AttentionBackend, ForwardBatch
from pagedllm.worker.input_batch import StepBuffers, aligned, int32_offsets

logger = logging.getLogger(__name__)


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


# the max_seq_len bounds below max_model_len that graphs may be captured for (context_buckets())
CONTEXT_BUCKETS = (1024, 4096)


@functools.cache
def context_buckets() -> tuple[int, ...]:
    """The bounds below max_model_len decode graphs are captured for, from
    PAGEDLLM_GRAPH_CONTEXT_BUCKETS (read once): unset or 1 CONTEXT_BUCKETS, 0 none, or the bounds
    themselves, comma-separated positive integers (for A/B runs, e.g. "512,1024,4096"); anything
    else a ValueError naming the variable."""
    value = os.environ.get("PAGEDLLM_GRAPH_CONTEXT_BUCKETS", "").strip()
    if value in ("", "1"):
        return CONTEXT_BUCKETS
    if value == "0":
        return ()
    parts = [p.strip() for p in value.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"PAGEDLLM_GRAPH_CONTEXT_BUCKETS={value!r}: expected 0, 1 or comma-separated bounds")
    return tuple(sorted({int(p) for p in parts}))


def context_bounds(sizes: list[int], max_model_len: int, split_counts,
                   buckets: tuple[int, ...] = CONTEXT_BUCKETS) -> dict[int, list[int]]:  # fmt: skip
    """Per batch size, the ascending max_seq_len bounds to capture a graph for: max_model_len, and
    each of `buckets` below it whose split counts (`split_counts(bs, bound)`, a tuple over the
    model's attention layers) differ from the next larger bound kept."""
    bounds = {}
    for bs in sizes:
        kept = [max_model_len]
        for b in sorted((b for b in buckets if b < max_model_len), reverse=True):
            if split_counts(bs, b) != split_counts(bs, kept[0]):
                kept.insert(0, b)
        bounds[bs] = kept
    return bounds


def attention_kinds(model: Any) -> list[tuple[int, int]]:
    """(kv heads, sliding window or 0) of the model's distinct attention layers."""
    from pagedllm.model.layers.attention import Attention

    return sorted({(m.num_kv_heads, m.sliding_window or 0) for m in model.modules() if isinstance(m, Attention)})


def decode_split_counts(kinds: list[tuple[int, int]], bs: int, bound: int, sms: int) -> tuple[int, ...]:
    """The decode kernel's split count at batch bs and max_seq_len bound, per attention kind."""
    from pagedllm.kernels.attention_decode import decode_num_splits

    return tuple(decode_num_splits(bs, hkv, min(bound, window) if window else bound, sms) for hkv, window in kinds)


class DecodeGraphs:
    def __init__(self, model: Any, buffers: StepBuffers, max_bs: int, max_model_len: int,
                 backend: AttentionBackend, block_size: int):  # fmt: skip
        self.model = model
        # the attention metadata is built inside the captured forward: what the backend derives
        # from the batch (on the device) is recomputed from the buffers at every replay
        self.backend = backend
        self.block_size = block_size
        self.buffers = buffers
        self.device = buffers.ints.device
        self.max_bs = max_bs
        self.max_model_len = max_model_len
        self.max_blocks = buffers.block_tables.shape[1]
        self.sizes = batch_size_ladder(max_bs)
        self.bounds = context_bounds(self.sizes, max_model_len, self._split_counts, context_buckets())
        # the graph runs the LM head too: logits of every row, in the head's dtype (the sampler
        # converts where it needs float32); made by the first (uncaptured) forward pass
        self.logits: torch.Tensor | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch size, max_seq_len bound)
        self.pool: Any = None

    @functools.cached_property
    def _attention_kinds(self) -> list[tuple[int, int]]:
        return attention_kinds(self.model)

    def _split_counts(self, bs: int, bound: int) -> tuple[int, ...]:
        from pagedllm.kernels._triton import num_sms

        return decode_split_counts(self._attention_kinds, bs, bound, num_sms(self.device.index or 0))

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _batch(self, bs: int, bound: int) -> ForwardBatch:
        """The views of the runner's StepBuffers a graph of batch size bs reads (their layout)."""
        ints, ints32 = self.buffers.ints, self.buffers.ints32
        s = aligned(bs)
        lens_at, _ = int32_offsets(bs)
        return ForwardBatch(
            input_ids=ints[:bs],
            positions=ints[s : s + bs],
            slot_mapping=ints[2 * s : 2 * s + bs],
            query_start_loc=ints32[: bs + 1],
            seq_lens=ints32[lens_at : lens_at + bs],
            block_tables=self.buffers.block_tables[:bs],
            logits_indices=ints[3 * s : 3 * s + bs],
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=bound,
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[bound] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.time()
        b = self.buffers
        order = [(size, bound) for size in reversed(self.sizes) for bound in reversed(self.bounds[size])]
        for bs, bound in order:  # the largest first: every graph fits the first one's pool
            batch = self._batch(bs, bound)
            # every row padding: nothing stored (slot -1), nothing read (seq_len 0)
            batch.input_ids.zero_()
            batch.positions.zero_()
            batch.slot_mapping.fill_(-1)
            b.ints32[: bs + 1] = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
            batch.seq_lens.zero_()
            batch.block_tables.zero_()
            batch.logits_indices.copy_(torch.arange(bs, device=self.device))
            for _ in range(2):  # compile kernels and settle allocations before capture
                self._forward(batch, bs)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._forward(batch, bs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[(bs, bound)] = g
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs for %d decode batch sizes (up to %d) in %.1fs",
            len(self.graphs),
            len(self.sizes),
            self.max_bs,
            time.time() - t0,
        )

    def _forward(self, batch: ForwardBatch, bs: int) -> None:
        batch.attn_metadata = self.backend.build_metadata(batch, self.block_size)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = torch.empty((self.max_bs, logits.shape[1]), dtype=logits.dtype, device=self.device)
        self.logits[:bs] = logits

    def can_run(self, num_reqs: int, num_tokens: int, num_decodes: int) -> bool:
        return num_decodes == num_reqs == num_tokens and num_reqs <= self.max_bs

    def run(self, num_reqs: int, max_seq_len: int) -> torch.Tensor:
        """Replays the graph of the padded size and the least bound at least max_seq_len (the
        step's longest context); the runner has laid out the step in the buffers for that size."""
        bs = self.padded_size(num_reqs)
        bound = next(b for b in self.bounds[bs] if b >= max_seq_len)
        self.graphs[(bs, bound)].replay()
        assert self.logits is not None
        return self.logits[:num_reqs]  # [n, vocab]; row i is token i
