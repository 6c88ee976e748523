"""A step's SamplingBatch: the sampling parameters of the requests that sample, as device
columns gathered from the runner's InputBatch rows in one copy. Only the rows flagged in the
batch (bans under min_tokens, bad words, logit_bias, allowed_token_ids, a grammar) and
penalties (which read the output history) take a per-request Python path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.model.logits_processors import LogitsEdits, banned_tail_tokens
from pagedllm.model.sampler import SamplingBatch, host_to_device
from pagedllm.structured_output.matcher import fill_bitmask

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import CachedRequestState, ModelRunner


def sampling_batch(runner: ModelRunner, reqs: list[CachedRequestState], rows: np.ndarray) -> SamplingBatch:
    """The sampling parameters of `reqs` (at InputBatch rows `rows`): the columns gathered
    from the batch in one copy; the Python path only for rows with bans, biases, allowed
    ids or a grammar, and for penalties (which read the output history)."""
    dev = runner.device
    ib = runner.batch

    def col(values, dtype=torch.float32):
        return host_to_device(values, dtype, dev)

    greedy_np = ib.greedy[rows]
    cols_np = np.stack(
        [ib.temperature[rows], ib.top_p[rows], ib.min_p[rows], ib.top_k[rows], greedy_np.astype(np.float32)]
    )
    cols = runner._to_device(cols_np)  # [5, S] float32
    any_top_k = bool((cols_np[3] < runner.vocab_size).any())
    any_top_p = bool((cols_np[1] < 1.0).any())
    any_min_p = bool((cols_np[2] > 0).any())
    sps = [r.sampling_params for r in reqs]
    penalized = [sp for sp in sps if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty]
    any_rep = any(sp.repetition_penalty != 1.0 for sp in penalized)
    any_freq = any(sp.frequency_penalty != 0 for sp in penalized)
    any_pres = any(sp.presence_penalty != 0 for sp in penalized)
    edits = LogitsEdits()
    grammar_rows = []
    for i in np.flatnonzero(ib.needs_edits[rows]).tolist():
        r = reqs[i]
        sp = r.sampling_params
        n_out = len(r.token_ids) - r.num_prompt_tokens
        ids = set()
        if n_out < sp.min_tokens:
            ids = set(sp.all_stop_token_ids)
            if not sp.ignore_eos:
                ids |= r.eos_token_ids
        if sp.bad_words_token_ids:
            ids.update(banned_tail_tokens(r.token_ids[r.num_prompt_tokens :], sp.bad_words_token_ids))
        if ids:
            edits.banned.append((i, sorted(t for t in ids if t < runner.vocab_size)))
        if sp.logit_bias:
            edits.bias.append((i, sp.logit_bias))
        if sp.allowed_token_ids:
            edits.allowed.append((i, sp.allowed_token_ids))
        if r.grammar is not None:
            grammar_rows.append(i)
    if grammar_rows:
        runner._accept_uncollected()
        bitmask = fill_bitmask(
            [reqs[i].grammar for i in grammar_rows],  # type: ignore[misc]
            runner.vocab_size,
            runner.pin,
        )
        edits.bitmask = bitmask.to(dev, non_blocking=True)
        edits.bitmask_rows = col(grammar_rows, torch.int64)
    need_tokens = any_rep or any_freq or any_pres
    num_logprobs = ib.num_logprobs[rows]
    return SamplingBatch(
        temperature=cols[0],
        greedy=cols[4] > 0.5,
        all_greedy=bool(greedy_np.all()),
        top_k=cols[3].long() if any_top_k else None,
        top_p=cols[1] if any_top_p else None,
        min_p=cols[2] if any_min_p else None,
        presence=col([sp.presence_penalty for sp in sps]) if any_pres else None,
        frequency=col([sp.frequency_penalty for sp in sps]) if any_freq else None,
        repetition=col([sp.repetition_penalty for sp in sps]) if any_rep else None,
        output_tokens=[r.token_ids[r.num_prompt_tokens :] for r in reqs] if need_tokens else None,
        prompt_tokens=[r.token_ids[: r.num_prompt_tokens] for r in reqs] if need_tokens else None,
        edits=edits,
        generators=[r.generator for r in reqs],
        num_logprobs=[None] * len(reqs) if (num_logprobs < 0).all() else [r.sampling_params.logprobs for r in reqs],
    )
