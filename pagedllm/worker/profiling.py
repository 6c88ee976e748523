"""Peak-memory profiling on CUDA: one dummy step at the largest batch the scheduler can form
(max_num_batched_tokens tokens as prefills, logits and sampling for max_num_seqs rows); and
`prefill_batch`, the step the startup runs outside the scheduler."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import ForwardBatch
from pagedllm.model.layers.attention import bind_kv_cache


def prefill_batch(input_ids: torch.Tensor, lens: list[int], block_size: int, rows: int) -> ForwardBatch:
    """Whole prompts of `lens` tokens (input_ids, their concatenation) as one prefill step, each
    sequence in its own run of cache blocks from block 0 (blocks a sequence: its longest's), the
    logits of the last `rows` tokens asked for: the startup's own steps (this profile,
    worker/kv_offset.py's calibration), outside the scheduler."""
    dev = input_ids.device
    n_tok = sum(lens)
    blocks_per_seq = -(-max(lens) // block_size)
    positions = np.concatenate([np.arange(n) for n in lens])
    slots = np.concatenate([i * blocks_per_seq * block_size + np.arange(n) for i, n in enumerate(lens)])
    tables = np.arange(len(lens) * blocks_per_seq, dtype=np.int32).reshape(len(lens), blocks_per_seq)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return ForwardBatch(
        input_ids=input_ids,
        positions=torch.from_numpy(positions).to(dev),
        slot_mapping=torch.from_numpy(slots).long().to(dev),
        query_start_loc=torch.from_numpy(qsl).to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=torch.from_numpy(tables).to(dev),
        logits_indices=torch.arange(n_tok - rows, n_tok, device=dev),
        num_decodes=0,
        max_query_len=max(lens),
        max_seq_len=max(lens),
        query_lens_cpu=list(lens),
        seq_lens_cpu=list(lens),
    )


@torch.inference_mode()
def profile_peak_memory(worker) -> tuple[int, int]:
    """Returns (peak bytes allocated by torch during the step, bytes used outside torch)."""
    cfg = worker.config
    sc, mc, cc = cfg.scheduler_config, cfg.model_config, cfg.cache_config
    dev = worker.device
    n_tok = sc.max_num_batched_tokens
    seq = min(mc.max_model_len, n_tok)
    n_seq = -(-n_tok // seq)
    lens = [seq] * (n_seq - 1) + [n_tok - seq * (n_seq - 1)]
    bs = cc.block_size
    blocks_per_seq = -(-seq // bs)
    nl = worker.num_layers  # of this rank's pipeline stage
    tmp = torch.zeros(
        (nl, 2, n_seq * blocks_per_seq, bs, worker.num_kv_heads, mc.head_dim), dtype=worker.kv_dtype, device=dev
    )
    bind_kv_cache(worker.model, [tmp[i, 0] for i in range(nl)], [tmp[i, 1] for i in range(nl)], worker.backend)
    rows = min(sc.max_num_seqs, n_tok)
    batch = prefill_batch(torch.randint(0, mc.vocab_size, (n_tok,), device=dev), lens, bs, rows)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    ps = worker.ps
    intermediate = None
    if not ps.is_first_stage:  # a later pipeline stage starts from hidden states, not token ids
        h = mc.hf_config.hidden_size
        intermediate = tuple(torch.zeros((n_tok, h), dtype=worker.kv_dtype, device=dev) for _ in range(2))
    hidden = worker.model(batch.input_ids, batch.positions, batch, intermediate)
    logits = None
    if ps.is_last_stage:
        logits = worker.model.compute_logits(hidden[batch.logits_indices]).float()
        logits.sort(dim=-1, descending=True)
        torch.softmax(logits, dim=-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - tmp.numel() * tmp.element_size()
    del tmp, batch, hidden, logits, intermediate
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
    return int(peak), int(non_torch)
