"""The worker side of structured outputs: one grammar matcher per request, and the packed
bitmask of a step's constrained rows.

A matcher follows the request's output tokens (accepted when the runner learns them); after a
preemption the runner builds a fresh one from the tokens so far, so no rollback is needed. The
bitmask is filled on the host (xgrammar, threaded across rows) into one int32 array and sent to
the device in one non-blocking copy; `apply_token_bitmask` unpacks it there.

    bitmask row r, word w, bit b  ->  token 32 * w + b is allowed at row r
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_BATCH_FILL_MIN_ROWS = 8  # below this, one fill call per row beats the batch fill's thread handoff
_batch_filler: Any = None  # one xgrammar BatchGrammarMatcher (its thread pool) per process; ~0.1 ms to build


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
        self.num_accepted += 1
        if self.terminated:
            return  # a look-ahead step's token after the end: the scheduler drops it
        if not self.matcher.accept_token(token_id):
            # only a token the mask allowed is sampled; this one came from elsewhere
            logger.warning("grammar rejected token %d after %d tokens; the rest is unconstrained",
                           token_id, self.num_accepted - 1)
            self.failed = True


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(grammars: list[RequestGrammar], vocab_size: int, pin: bool) -> torch.Tensor:
    """[G, ceil(V / 32)] int32 on the host: row g allows what grammars[g] allows next (all tokens
    once its grammar has ended)."""
    import xgrammar as xgr

    bitmask = torch.full((len(grammars), bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
    live = [i for i, g in enumerate(grammars) if not g.terminated]
    if len(live) >= _BATCH_FILL_MIN_ROWS:
        global _batch_filler
        if _batch_filler is None:
            _batch_filler = xgr.BatchGrammarMatcher()
        _batch_filler.batch_fill_next_token_bitmask(
            [grammars[i].matcher for i in live], bitmask, indices=live
        )
    else:
        for i in live:
            grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
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
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [G, V]
    sub = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, sub)


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)
