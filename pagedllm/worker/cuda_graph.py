"""CUDA graphs for decode steps.

A pure-decode step (every request has one query token) is replayed from a graph captured at
startup for the next batch size up in a ladder (1, 2, 4, 8, then steps of 8 up to the cap),
largest first so all graphs share one memory pool. Inputs are copied into static buffers;
padding rows get slot -1 (nothing stored) and seq_len 0 (the decode kernel writes zeros).
The attention grid depends only on the batch size and the `max_seq_len` bound, which is
`max_model_len` at capture and at replay.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagedllm.attention.backend import ForwardBatch

logger = logging.getLogger(__name__)


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    def __init__(
        self, model: Any, device: torch.device, max_bs: int, max_model_len: int, block_size: int, vocab_size: int
    ):
        self.model = model
        self.device = device
        self.max_bs = max_bs
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.sizes = batch_size_ladder(max_bs)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        # the graph runs the LM head too: logits of every row, in float32
        self.logits = torch.zeros(max_bs, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            logits_indices=self.logits_indices[:bs],
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.time()
        for bs in reversed(self.sizes):
            batch = self._batch(bs)
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
        hidden = self.model(batch.input_ids, batch.positions, batch)
        self.logits[:bs] = self.model.compute_logits(hidden).float()

    def can_run(self, batch: ForwardBatch) -> bool:
        n = batch.num_reqs
        return (
            batch.num_decodes == n
            and batch.num_tokens == n
            and n <= self.max_bs
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_reqs
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        mb = batch.block_tables.shape[1]
        self.block_tables[:n, :mb].copy_(batch.block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        return self.logits[:n]  # [n, vocab] float32; row i is token i
