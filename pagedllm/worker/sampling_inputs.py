"""The sampling inputs of a step's sampled rows, gathered from the runner's InputBatch: the
parameter columns in one copy, penalties from the histories on the device, and the few rows
that need a Python path (bans while `min_tokens` is not reached, bad words, logit_bias,
allowed ids, a grammar)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.model.logits_processors import LogitsEdits, banned_tail_tokens
from pagedllm.model.sampler import SamplingBatch, host_to_device
from pagedllm.worker.input_batch import (
    FREQUENCY,
    GREEDY,
    MIN_P,
    PRESENCE,
    REPETITION,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    CachedRequestState,
    InputBatch,
)


def array_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on `device` without waiting for the stream: through pinned memory,
    non-blocking, on CUDA; the same memory on the CPU."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def sampling_batch(ib: InputBatch, reqs: list[CachedRequestState], rows: np.ndarray, vocab_size: int,
               device: torch.device) -> tuple[SamplingBatch, list[int]]:  # fmt: skip
    """The sampling inputs of `reqs` (at InputBatch `rows`): the parameter columns in one
    copy, penalties from the device histories; only rows with bans (min_tokens not yet
    reached, bad words), biases, allowed ids or a grammar take the per-request path. Also
    the indices of the rows with a grammar (their bitmask is left to the grammar step)."""
    cols_np = np.ascontiguousarray(ib.cols[rows].T)  # [len(COLS), S]
    cols = array_to_device(cols_np, device)
    any_top_k = bool((cols_np[TOP_K] < vocab_size).any())
    any_top_p = bool((cols_np[TOP_P] < 1.0).any())
    any_min_p = bool((cols_np[MIN_P] > 0).any())
    any_rep = bool((cols_np[REPETITION] != 1.0).any())
    any_freq = bool((cols_np[FREQUENCY] != 0).any())
    any_pres = bool((cols_np[PRESENCE] != 0).any())
    # output tokens before the one sampled now (exact under asynchronous scheduling too)
    num_out = ib.num_computed[rows] - ib.num_prompt[rows]
    python_rows = np.flatnonzero(ib.python_edits[rows] | (num_out < ib.min_tokens[rows])).tolist()
    edits = LogitsEdits()
    grammar_rows = []
    for i in python_rows:
        r = reqs[i]
        sp = r.sampling_params
        n_out = int(num_out[i])
        ids = set()
        if n_out < sp.min_tokens:
            ids = set(sp.all_stop_token_ids)
            if not sp.ignore_eos:
                ids |= r.eos_token_ids
        if sp.bad_words_token_ids:
            ids.update(banned_tail_tokens(r.token_ids[r.num_prompt_tokens :], sp.bad_words_token_ids))
        if ids:
            edits.banned.append((i, sorted(t for t in ids if t < vocab_size)))
        if sp.logit_bias:
            edits.bias.append((i, sp.logit_bias))
        if sp.allowed_token_ids:
            edits.allowed.append((i, sp.allowed_token_ids))
        if r.grammar is not None:
            grammar_rows.append(i)
    if grammar_rows:
        edits.bitmask_rows = host_to_device(grammar_rows, torch.int64, device)
        row_map = np.full(len(reqs), -1, dtype=np.int32)
        row_map[grammar_rows] = np.arange(len(grammar_rows), dtype=np.int32)
        edits.bitmask_row_map = array_to_device(row_map, device)
    counts = mask = rows_dev = None
    if any_rep or any_freq or any_pres:
        assert ib.output_counts is not None and ib.prompt_mask is not None
        rows_dev = array_to_device(rows, device)
        counts = ib.output_counts[rows_dev]
        mask = ib.prompt_mask[rows_dev] if any_rep else None
    nl = ib.num_logprobs[rows]
    num = len(reqs)
    sb = SamplingBatch(
        temperature=cols[TEMPERATURE],
        greedy=cols[GREEDY] != 0,
        all_greedy=bool(cols_np[GREEDY].all()),
        top_k=cols[TOP_K].long() if any_top_k else None,
        top_p=cols[TOP_P] if any_top_p else None,
        min_p=cols[MIN_P] if any_min_p else None,
        presence=cols[PRESENCE] if any_pres else None,
        frequency=cols[FREQUENCY] if any_freq else None,
        repetition=cols[REPETITION] if any_rep else None,
        output_counts=counts,
        prompt_mask=mask,
        history_rows=rows_dev,
        edits=edits,
        generators=[r.generator for r in reqs] if ib.seeded[rows].any() else [None] * num,
        num_logprobs=[None] * num if (nl < 0).all() else [None if k < 0 else k for k in nl.tolist()],
    )
    return sb, grammar_rows
