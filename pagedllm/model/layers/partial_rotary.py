"""Partial and interleaved rotary embeddings as a permutation of each head's q/k dims.

Attention only needs q . k per head, which any permutation of the head dims applied to both q
and k keeps. So a model whose rotary covers only the first rotary_dim = r dims of a head
(GPT-NeoX, GLM-4), or pairs dims (2i, 2i+1) instead of (i, i + r/2) (GLM-4's GPT-J style),
permutes the rows of its q and k projections once at load so that the rotating pairs land
where the full-width rotate-half kernel expects them, (j, j + D/2); the pass-through dims fill
the rest and rotate by frequency 0, which leaves them exactly as they are (rotary.py):

    head dims (D = 8, r = 4)     new layout:  | a0 a1 p0 p1 | b0 b1 p2 p3 |   (j pairs with j + D/2)
    rotate-half  (NeoX):  a_i = i,      b_i = i + r/2,   p = r, r+1, ...
    interleaved  (GLM-4): a_i = 2i,     b_i = 2i + 1

V is not permuted, so the attention output is unchanged; K sits in the cache permuted.
"""

from __future__ import annotations

import torch


def partial_rotary_permutation(head_dim: int, rotary_dim: int, interleaved: bool) -> list[int] | None:
    """perm with new dim j = old dim perm[j] within a head; None when it is the identity."""
    if rotary_dim == head_dim and not interleaved:
        return None
    half, h = head_dim // 2, rotary_dim // 2
    a = [2 * i for i in range(h)] if interleaved else list(range(h))
    b = [2 * i + 1 for i in range(h)] if interleaved else list(range(h, rotary_dim))
    rest = list(range(rotary_dim, head_dim))
    return a + rest[: half - h] + b + rest[half - h :]


def permute_head_rows(t: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """Rows of t ([heads * D, ...] or [heads * D]) permuted within each head of D = len(perm)."""
    d = len(perm)
    index = torch.tensor(perm, device=t.device)
    return t.reshape(-1, d, *t.shape[1:]).index_select(1, index).reshape(t.shape)


class PermutedHeadRows:
    """A checkpoint tensor (or lazy slice, model/loader.py) seen with its head rows permuted, for
    the weight loaders: `.shape`, `.narrow` (whole heads along dim 0, as the q/k loaders take
    them) and `.load()`."""

    __slots__ = ("_loaded", "_perm", "shape")

    def __init__(self, loaded, perm: list[int]):
        if int(loaded.shape[0]) % len(perm):
            raise ValueError(f"{tuple(loaded.shape)} rows are not whole heads of {len(perm)} dims")
        self._loaded, self._perm, self.shape = loaded, perm, torch.Size(loaded.shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        d = len(self._perm)
        if dim == 0 and (start % d or length % d):
            raise ValueError(f"rows [{start}, {start + length}) are not whole heads of {d} dims")
        return permute_head_rows(self._loaded.narrow(dim, start, length), self._perm)

    def load(self) -> torch.Tensor:
        t = self._loaded if isinstance(self._loaded, torch.Tensor) else self._loaded.load()
        return permute_head_rows(t, self._perm)


def permuted_head_rows(loaded, perm: list[int]):
    """`loaded` (a checkpoint tensor, lazy slice or GGUF block tensor) seen with its rows
    permuted within each head: GGUF blocks, which move whole rows (`permute_rows`), at once;
    anything else lazily (PermutedHeadRows)."""
    if not hasattr(loaded, "permute_rows"):
        return PermutedHeadRows(loaded, perm)
    d, rows = len(perm), int(loaded.shape[0])
    if rows % d:
        raise ValueError(f"{rows} rows are not whole heads of {d} dims")
    return loaded.permute_rows(torch.arange(rows).reshape(-1, d)[:, perm].reshape(-1).numpy())
