"""Sampling a batch of next tokens from logits, each row with its own SamplingParams.

Order of work per row: penalties (repetition, frequency, presence), then the logits edits of
model/logits_processors.py (logit_bias, allowed_token_ids, bad_words and min_tokens bans, the
structured-output grammar bitmask); then greedy rows take the argmax, random rows divide by temperature, keep top-k,
top-p and min-p, and draw with the exponential-race trick (argmax of p / q, q ~ Exp(1)) so a
per-request `seed` gives the same draw whatever the batch. Logprobs are from the raw logits
(before any processing), as vLLM reports them by default.

On CUDA, a batch without top-k / top-p / min-p and without per-request seeds is drawn by one
Triton kernel (kernels/sampling_triton.py: Gumbel-max, one pass over the logits), after the
penalties and the other edits above; it applies the grammar bitmask itself, as it reads the
logits (so a constrained batch, greedy ones too, costs no extra pass over [S, V]).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.kernels._triton import env_flag, use_triton
from pagedllm.model.logits_processors import LogitsEdits, apply_logits_edits
from pagedllm.outputs import TokenLogprobs


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [S] float32, 1.0 where greedy
    greedy: torch.Tensor  # [S] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [S] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [S] float32
    min_p: torch.Tensor | None  # [S] float32
    presence: torch.Tensor | None  # [S] float32
    frequency: torch.Tensor | None  # [S] float32
    repetition: torch.Tensor | None  # [S] float32
    output_counts: torch.Tensor | None  # [S, V] int32 occurrences in the output (penalties)
    prompt_mask: torch.Tensor | None  # [S, V] bool in the prompt (repetition)
    history_rows: torch.Tensor | None  # [S] int64 the rows those came from (the runner's, to count the samples)
    edits: LogitsEdits  # logit_bias, allowed_token_ids, bans, grammar bitmask
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    num_logprobs: list[int | None]  # per row


def host_to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a device tensor without a synchronizing copy: through pinned memory,
    non-blocking, on CUDA (a plain `torch.tensor(values, device="cuda")` waits for the whole
    stream, which would stall the overlap of host and device work)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Repetition (vLLM's and transformers': tokens of the prompt and the output so far),
    frequency and presence (OpenAI's: tokens of the output) penalties, from the histories the
    runner keeps on the device."""
    counts = sb.output_counts
    assert counts is not None
    if sb.repetition is not None:
        assert sb.prompt_mask is not None
        seen = sb.prompt_mask | (counts > 0)
        r = sb.repetition[:, None]
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalized, logits)
    if sb.frequency is not None or sb.presence is not None:
        if sb.frequency is not None:
            logits = logits - sb.frequency[:, None] * counts
        if sb.presence is not None:
            logits = logits - sb.presence[:, None] * (counts > 0).float()
    return logits


@dataclass(slots=True)
class LogprobTensors:
    """The logprob results of the rows in `rows` (those whose `num[row]` is not None), as
    tensors: queued on the device by `logprob_tensors`, read on the host by `logprob_lists`."""

    rows: list[int]
    num: list[int | None]
    chosen: torch.Tensor  # [R] the sampled (or target) token of each row
    chosen_lp: torch.Tensor  # [R] its logprob
    ranks: torch.Tensor  # [R] its rank (1 = the most likely)
    top_lp: torch.Tensor  # [R, k] the k most likely tokens' logprobs (k = max of num)
    top_ids: torch.Tensor  # [R, k]

    def to_host(self) -> LogprobTensors:
        """Copies on CUDA into pinned memory without waiting (valid once the stream got there);
        on the CPU the same object."""
        if self.chosen.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor) -> torch.Tensor:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return h.copy_(t, non_blocking=True)

        return LogprobTensors(self.rows, self.num, pinned(self.chosen), pinned(self.chosen_lp), pinned(self.ranks),
                              pinned(self.top_lp), pinned(self.top_ids))


def logprob_tensors(logits: torch.Tensor, sampled: torch.Tensor, num: list[int | None]) -> LogprobTensors | None:
    """Queues the logprobs of the sampled tokens and the top-k, for rows that asked (k = num[row]);
    nothing here waits for the device."""
    rows = [i for i, n in enumerate(num) if n is not None]
    if not rows:
        return None
    idx = host_to_device(rows, torch.int64, logits.device) if len(rows) < len(num) else None
    lp = torch.log_softmax((logits if idx is None else logits[idx]).float(), dim=-1)
    chosen = sampled if idx is None else sampled[idx]
    chosen_lp = lp.gather(1, chosen[:, None])
    ranks = (lp > chosen_lp).sum(-1) + 1
    k = max(num[i] for i in rows)
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return LogprobTensors(rows, num, chosen, chosen_lp[:, 0], ranks, top_lp, top_ids)


def logprob_lists(t: LogprobTensors | None, n: int) -> list[TokenLogprobs | None]:
    """One entry per row of the `n`: TokenLogprobs where asked, else None."""
    out: list[TokenLogprobs | None] = [None] * n
    if t is None:
        return out
    chosen_l, chosen_lp_l, ranks_l = t.chosen.tolist(), t.chosen_lp.tolist(), t.ranks.tolist()
    top_lp_l, top_ids_l = t.top_lp.tolist(), t.top_ids.tolist()
    for j, i in enumerate(t.rows):
        k = t.num[i]
        out[i] = TokenLogprobs(chosen_l[j], chosen_lp_l[j], ranks_l[j], top_ids_l[j][:k], top_lp_l[j][:k])
    return out


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, num: list[int | None]) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens and the top-k, for rows that asked (k = num[row])."""
    return logprob_lists(logprob_tensors(logits, sampled, num), len(num))


@functools.cache
def greedy_triton() -> bool:
    """Whether an all-greedy batch on CUDA takes its argmax through the fused sampler's kernels (each
    row split over ~1,024 programs, then their bests) instead of torch's argmax, which took 29 us a
    step for one row of Llama-3's 128,256 logits on the H200 (W2's profile, RESULTS.md fourteenth
    session): on unless PAGEDLLM_GREEDY_TRITON=0 (read once). The H100, W2 gptq: 2.89 -> 2.86
    ms/token, and 2.69 -> 2.67 with gemvp under PDL (RESULTS.md twenty-second session)."""
    return env_flag("PAGEDLLM_GREEDY_TRITON", default=True)


@functools.cache
def _unused_seed(device: torch.device) -> torch.Tensor:
    """The fused sampler's seed where every row is greedy (read, never used)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def sample(logits: torch.Tensor, sb: SamplingBatch, default_gen: torch.Generator | None) -> torch.Tensor:
    """logits: [S, V] (float32, or the LM head's 16-bit dtype) -> token ids [S] int64. The fused
    kernel and a greedy argmax read 16-bit logits as they are (the same values, one read of half
    the bytes); every other path works on a float32 copy."""
    raw = logits
    penalties = sb.repetition is not None or sb.frequency is not None or sb.presence is not None
    fused = (sb.top_k is None and sb.top_p is None and sb.min_p is None and use_triton(logits)
             and all(g is None for g in sb.generators) and logits.numel() < 2**31)
    mask_in_kernel = fused and sb.edits.bitmask is not None
    e = sb.edits
    torch_edits = bool(e.bias or e.allowed or e.banned) or (e.bitmask is not None and not mask_in_kernel)
    if logits.dtype != torch.float32 and (penalties or torch_edits or not (fused or sb.all_greedy)):
        logits = logits.float()
    if penalties:
        logits = apply_penalties(logits, sb)
    if sb.edits:
        logits = apply_logits_edits(logits, sb.edits, lambda v, dtype: host_to_device(v, dtype, raw.device),
                                    bitmask=not mask_in_kernel)
    if sb.all_greedy and not mask_in_kernel:
        if fused and greedy_triton():
            from pagedllm.kernels.sampling_triton import sample_triton

            return sample_triton(logits, sb.temperature, sb.greedy, _unused_seed(logits.device))
        return cpu_kernels.argmax(logits)
    if fused:
        from pagedllm.kernels.sampling_triton import sample_triton

        seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device, generator=default_gen)
        if mask_in_kernel:
            return sample_triton(logits, sb.temperature, sb.greedy, seed, sb.edits.bitmask, sb.edits.bitmask_row_map)
        return sample_triton(logits, sb.temperature, sb.greedy, seed)
    greedy_tokens = cpu_kernels.argmax(logits)
    x = logits / sb.temperature[:, None]
    vocab = x.shape[1]
    if sb.top_k is not None or sb.top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if sb.top_k is not None:
            drop |= torch.arange(vocab, device=x.device)[None, :] >= sb.top_k[:, None]
        if sb.top_p is not None:
            probs_sorted = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly before each token
            drop |= before >= sb.top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    probs = x.softmax(dim=-1)
    if sb.min_p is not None:
        keep = probs >= sb.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    q = torch.empty_like(probs)
    if any(g is None for g in sb.generators):
        q.exponential_(generator=default_gen)
    for i, g in enumerate(sb.generators):
        if g is not None:
            q[i].exponential_(generator=g)
    random_tokens = (probs / q).argmax(dim=-1)
    return torch.where(sb.greedy, greedy_tokens, random_tokens)
