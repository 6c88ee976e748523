"""CUDA graphs for decode steps.

A pure-decode step (every request has one query token) is replayed from a graph captured at
startup for the next batch size up in a ladder (1, 2, 4, 8, then steps of 8 up to the cap),
largest first so all graphs share one memory pool. The graphs read the runner's StepBuffers
(worker/input_batch.py): the runner lays out a decode step padded to the graph's batch size
there, so replaying copies nothing; padding rows get slot -1 (nothing stored) and seq_len 0
(the decode kernel writes zeros).
The attention grid depends only on the batch size and the `max_seq_len` bound, which is
`max_model_len` at capture and at replay.
"""

from __future__ import annotations

import logging
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
        # the graph runs the LM head too: logits of every row, in the head's dtype (the sampler
        # converts where it needs float32); made by the first (uncaptured) forward pass
        self.logits: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _batch(self, bs: int) -> ForwardBatch:
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
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.time()
        b = self.buffers
        for bs in reversed(self.sizes):
            batch = self._batch(bs)
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
            self.graphs[bs] = g
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (up to %d) in %.1fs",
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

    def run(self, num_reqs: int) -> torch.Tensor:
        """Replays the graph of the padded size; the runner has laid out the step in the
        buffers for that size."""
        self.graphs[self.padded_size(num_reqs)].replay()
        assert self.logits is not None
        return self.logits[:num_reqs]  # [n, vocab]; row i is token i
