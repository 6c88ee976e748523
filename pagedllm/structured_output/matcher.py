"""The worker side of structured outputs: one grammar matcher per request, and the packed
bitmask of a step's constrained rows.

A matcher follows the request's output tokens (accepted when the runner learns them); after a
preemption the runner builds a fresh one from the tokens so far, so no rollback is needed. The
bitmask is filled on the host (xgrammar, threaded across rows: `grammar_threads()`) into one
int32 array and sent to the device in one non-blocking copy; the Triton sampler reads it as it
is, the torch path unpacks it (`apply_token_bitmask`). On CUDA the runner does a step's grammar
work (`grammar_step`: wait for the previous step's tokens, accept them, fill) on a thread of its
own while the engine thread collects, detokenizes and schedules (worker/model_runner.py).

    bitmask row r, word w, bit b  ->  token 32 * w + b is allowed at row r
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

_BATCH_FILL_MIN_ROWS = 8  # below this, one fill call per row beats the batch fill's thread handoff
_batch_filler: Any = None  # one xgrammar BatchGrammarMatcher (its thread pool) per process; ~0.1 ms to build
# Seconds spent, summed over steps, by `grammar_step` (wait for the previous step's tokens,
# accept them, fill the masks) and by the engine thread waiting for it (`join`): cheap
# counters (a few clock reads a step) that benchmarks/structured_bench.py prints.
# With a GrammarPool, "fill" is the whole round trip and "worker_fill" the slowest worker's own time.
GRAMMAR_TIMES = {"steps": 0, "rows": 0, "wait_prev": 0.0, "accept": 0.0, "fill": 0.0, "join": 0.0, "worker_fill": 0.0}


def grammar_threads() -> int:
    """Threads of the batch fill: PAGEDLLM_GRAMMAR_THREADS, else half the cores this process may
    run on (xgrammar's own "auto" counts the host's cores, not the container's), at most 8."""
    env = os.environ.get("PAGEDLLM_GRAMMAR_THREADS")
    if env:
        return max(1, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // 2))


class RequestGrammar:
    """A request's matcher and how many of its output tokens it has seen."""

    __slots__ = ("matcher", "num_accepted", "failed")

    def __init__(self, matcher: Any, output_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.failed = False
        for t in output_token_ids:
            self.accept(t)

    @property
    def terminated(self) -> bool:
        return self.failed or self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        accept_tokens([self], [token_id])


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(grammars: list[RequestGrammar], vocab_size: int, pin: bool) -> torch.Tensor:
    """[G, ceil(V / 32)] int32 on the host: row g allows what grammars[g] allows next (all tokens
    once its grammar has ended)."""
    bitmask = torch.full((len(grammars), bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
    fill_rows(bitmask, grammars, list(range(len(grammars))))
    return bitmask


def fill_rows(bitmask: torch.Tensor, grammars: list[RequestGrammar], rows: list[int]) -> None:
    """Row rows[i] of `bitmask` [R, W] (all -1 on entry) gets what grammars[i] allows next (left
    all -1 once its grammar has ended)."""
    import xgrammar as xgr

    live = [i for i, g in enumerate(grammars) if not g.terminated]
    if len(live) >= _BATCH_FILL_MIN_ROWS:
        global _batch_filler
        if _batch_filler is None:
            _batch_filler = xgr.BatchGrammarMatcher(max_threads=grammar_threads())
        _batch_filler.batch_fill_next_token_bitmask(
            [grammars[i].matcher for i in live], bitmask, indices=[rows[i] for i in live]
        )
    else:
        for i in live:
            grammars[i].matcher.fill_next_token_bitmask(bitmask, rows[i])


def accept_tokens(grammars: list[RequestGrammar], tokens: list[int]) -> None:
    """grammars[i] accepts tokens[i]; many at once in one xgrammar call (no Python per token)."""
    import xgrammar as xgr

    live = []
    for g in grammars:
        g.num_accepted += 1
        live.append(not g.terminated)  # a look-ahead step's token after the end: dropped
    idx = [i for i, ok in enumerate(live) if ok]
    if len(idx) >= _BATCH_FILL_MIN_ROWS:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([grammars[i].matcher for i in idx],
                                                              [tokens[i] for i in idx])
    else:
        accepted = [grammars[i].matcher.accept_token(tokens[i]) for i in idx]
    for i, ok in zip(idx, accepted):
        if not ok:
            g = grammars[i]
            logger.warning("grammar rejected token %d after %d tokens; the rest is unconstrained",
                           tokens[i], g.num_accepted - 1)
            g.failed = True


class LocalGrammars:
    """The matchers in this process (the default on the CPU); structured_output/pool.py's
    GrammarPool has the same methods with the matchers in worker processes."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def new(self, so: Any, compiled: Any, output_token_ids: list[int]) -> RequestGrammar:
        return RequestGrammar(new_matcher(compiled), output_token_ids)

    def release(self, g: RequestGrammar) -> None:
        pass

    def accept(self, grammars: list[RequestGrammar], tokens: list[int]) -> None:
        accept_tokens(grammars, tokens)

    def fill(self, grammars: list[RequestGrammar], pin: bool) -> torch.Tensor:
        return fill_bitmask(grammars, self.vocab_size, pin)


def grammar_step(backend: Any, prev_ready: Any, prev_tokens: torch.Tensor | None, prev_rows: list[int],
                 prev_grammars: list, grammars: list, pin: bool) -> torch.Tensor:
    """One step's grammar work: wait for the previous launch's tokens (`prev_ready`, a CUDA event,
    or None), feed its rows `prev_rows` to `prev_grammars`, then fill the masks of `grammars`
    (through `backend`: LocalGrammars or a GrammarPool)."""
    t0 = time.perf_counter()
    if prev_ready is not None:
        prev_ready.synchronize()
    t1 = time.perf_counter()
    if prev_grammars:
        assert prev_tokens is not None
        tokens = prev_tokens[prev_rows].tolist() if len(prev_rows) < len(prev_tokens) else prev_tokens.tolist()
        backend.accept(prev_grammars, tokens)
    t2 = time.perf_counter()
    bitmask = backend.fill(grammars, pin)
    t3 = time.perf_counter()
    gt = GRAMMAR_TIMES
    gt["steps"] += 1
    gt["rows"] += len(grammars)
    gt["wait_prev"] += t1 - t0
    gt["accept"] += t2 - t1
    gt["fill"] += t3 - t2
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 -> [G, V] bool (True = allowed), on the bitmask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [S, V]; bitmask [G, W] int32 and rows [G] int64 on the logits' device. Returns new
    logits with the disallowed tokens of rows[g] at -inf (the input is left as it was: logprobs
    are reported from the raw logits)."""
    from pagedllm.kernels import cpu_kernels

    if logits.device.type == "cpu":
        out = logits.clone()
        if cpu_kernels.bitmask_fill_(out, bitmask, rows):
            return out
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [G, V]
    sub = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, sub)


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)
