"""Per-request edits of the logits before sampling: logit_bias, allowed_token_ids, banned
tokens (bad_words, min_tokens' stop tokens) and the grammar bitmask of structured outputs.

The runner gathers each kind over the step's rows on the host (`LogitsEdits`); each is applied
with one indexed operation on the device, so nothing here loops over requests on the device or
waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.structured_output.matcher import apply_token_bitmask


@dataclass(slots=True)
class LogitsEdits:
    bias: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (row, token -> bias)
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, the only tokens allowed)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids at -inf)
    bitmask: torch.Tensor | None = None  # [G, W] int32 on the device
    bitmask_rows: torch.Tensor | None = None  # [G] int64 on the device
    bitmask_row_map: torch.Tensor | None = None  # [S] int32 on the device: row -> its bitmask row, or -1

    def __bool__(self) -> bool:
        return bool(self.bias or self.allowed or self.banned or self.bitmask is not None)


def banned_tail_tokens(output_ids: list[int], bad_words: list[list[int]]) -> list[int]:
    """bad_words' tokens to ban next: a one-token word always, a longer word's last token when
    the output ends with the word's other tokens."""
    out = []
    for w in bad_words:
        prefix = w[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix):] == prefix):
            out.append(w[-1])
    return out


def apply_logits_edits(logits: torch.Tensor, edits: LogitsEdits, to_device, bitmask: bool = True) -> torch.Tensor:
    """logits [S, V] float32 -> edited logits (a new tensor when anything changes).
    to_device(values, dtype) puts a host list on the logits' device without a sync. With
    bitmask=False the grammar bitmask is left to the caller (the Triton sampler reads it)."""
    if edits.bias:
        rows = [r for r, b in edits.bias for _ in b]
        ids = [t for _, b in edits.bias for t in b]
        vals = to_device([v for _, b in edits.bias for v in b.values()], torch.float32)
        idx = to_device([rows, ids], torch.int64)
        logits = logits.index_put((idx[0], idx[1]), vals, accumulate=True)
    if edits.allowed:
        rows = [r for r, a in edits.allowed for _ in a]
        idx = to_device([rows, [t for _, a in edits.allowed for t in a]], torch.int64)
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        keep[idx[0], idx[1]] = True
        constrained = to_device([r for r, _ in edits.allowed], torch.int64)
        keep_rows = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        keep_rows[constrained] = False
        logits = logits.masked_fill(~(keep | keep_rows[:, None]), float("-inf"))
    if edits.banned:
        rows = [r for r, ids in edits.banned for _ in ids]
        idx = to_device([rows, [t for _, ids in edits.banned for t in ids]], torch.int64)
        logits = logits.index_put((idx[0], idx[1]), torch.tensor(float("-inf"), device=logits.device))
    if bitmask and edits.bitmask is not None:
        logits = apply_token_bitmask(logits, edits.bitmask, edits.bitmask_rows)
    return logits
