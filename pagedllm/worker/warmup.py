"""Compiling at startup the decode kernel variants that steps mixing decodes with prefill chunks run.

A step of decodes only replays a CUDA graph captured at startup (cuda_graph.py), so every kernel it
runs was compiled then. A step that mixes decodes with prefill chunks runs eagerly, and its decodes
take the decode kernel without the fused rotary (qkv_rope's kernel runs first), a variant no graph
holds: its constexprs are whether the step orders its decodes (two or more), whether it splits the
keys (num_splits > 1, from the number of decodes and the step's longest context) and whether the
last split merges them (decode_last_reduce). Left to the first step that needs each one, a variant
compiles in the middle of serving, about half a second on a machine whose Triton cache lacks it (W1
on an H100: the first mixed steps compiled two, 1.2 s in a 18 s run; RESULTS.md, thirty-fifth
session). `warm_mixed_steps` runs one mixed step of padding for each variant the scheduler can form
instead: its decodes read nothing (seq_len 0) and nothing is stored (slot -1).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pagedllm.attention.backend import AttentionBackend, ForwardBatch
from pagedllm.worker.cuda_graph import decode_split_counts

logger = logging.getLogger(__name__)

# whether the step's decodes are ordered; per attention kind, (split, the last split merging)
VariantKey = tuple[bool, tuple[tuple[bool, bool], ...]]


def mixed_step_variants(kinds: list[tuple[int, int, int, int]], max_decodes: int, max_model_len: int, sms: int,
                        ordered: bool) -> dict[VariantKey, tuple[int, int]]:  # fmt: skip
    """Per decode kernel variant a mixed step can take, the fewest decodes (and the least max_seq_len
    bound) that take it. kinds: (kv heads, sliding window or 0, the cache's bytes per element, the
    head dim padded to a power of two) of the model's attention layers; a step holds 1..max_decodes
    decodes and a context of at most max_model_len. A variant's key: whether the decodes are ordered,
    and per kind (split, the last split merging)."""
    from pagedllm.kernels.attention_decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT
    from pagedllm.kernels.attention_merge import decode_last_reduce

    bounds = sorted({min(max_model_len, MIN_TOKENS_PER_SPLIT * i) for i in range(1, MAX_SPLITS + 1)})
    heads_windows = [(h, w) for h, w, _, _ in kinds]
    found: dict[VariantKey, tuple[int, int]] = {}
    for nd in range(1, max_decodes + 1):
        for bound in bounds:
            splits = decode_split_counts(heads_windows, nd, bound, sms)
            key = (ordered and nd >= 2, tuple(
                (s > 1, s > 1 and decode_last_reduce(s, itemsize, block_d))
                for s, (_, _, itemsize, block_d) in zip(splits, kinds)))  # fmt: skip
            found.setdefault(key, (nd, bound))
        # (split counts do not grow with the decodes: once none splits at the longest bound, more
        # decodes take this nd's variant)
        if nd >= 2 and all(s == 1 for s in decode_split_counts(heads_windows, nd, bounds[-1], sms)):
            break
    return found


def _mixed_batch(nd: int, bound: int, block_tables: torch.Tensor) -> ForwardBatch:
    """nd decodes of padding (seq_len 0: nothing read) and one prefill chunk of one token (seq_len
    1: block 0's first key, which it does not store either); the runner's block-table rows."""
    n, dev = nd + 1, block_tables.device
    seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
    seq_lens[nd] = 1
    block_tables[:n].zero_()
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long, device=dev),
        positions=torch.zeros(n, dtype=torch.long, device=dev),
        slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=seq_lens,
        block_tables=block_tables[:n],
        logits_indices=torch.arange(n, device=dev),
        num_decodes=nd,
        max_query_len=1,
        max_seq_len=bound,
        query_lens_cpu=[1] * n,
        seq_lens_cpu=[bound] * nd + [1],
    )


@torch.inference_mode()
def warm_mixed_steps(model: Any, backend: AttentionBackend, block_tables: torch.Tensor, block_size: int,
                     max_decodes: int, max_model_len: int) -> int:  # fmt: skip
    """Runs one mixed step of padding for each decode kernel variant mixed steps can take (see the
    module); returns how many ran. block_tables: the runner's buffer (rows of zeros are written)."""
    from pagedllm.kernels._triton import next_power_of_2, num_sms
    from pagedllm.model.layers.attention import Attention

    if max_decodes < 1:
        return 0
    t0 = time.time()
    kinds = sorted({(m.num_kv_heads, m.sliding_window or 0, m.k_cache.element_size(), next_power_of_2(m.head_dim))
                    for m in model.modules() if isinstance(m, Attention) and m.k_cache is not None})  # fmt: skip
    variants = mixed_step_variants(kinds, max_decodes, max_model_len, num_sms(block_tables.device.index or 0),
                                   ordered=getattr(backend, "order_decodes", False))  # fmt: skip
    for nd, bound in variants.values():
        batch = _mixed_batch(nd, bound, block_tables)
        batch.attn_metadata = backend.build_metadata(batch, block_size)
        model(batch.input_ids, batch.positions, batch)
    torch.cuda.synchronize(block_tables.device)
    logger.info("ran %d mixed steps of padding (the decode kernel's variants) in %.1fs", len(variants),
                time.time() - t0)  # fmt: skip
    return len(variants)
