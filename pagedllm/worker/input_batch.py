"""InputBatch: the runner's per-request rows, kept across steps in preallocated numpy arrays
and changed only where a request joins, leaves, gains blocks or gains tokens. A step's inputs
are gathered from them with numpy indexing by row (no per-request Python arithmetic):

    row r:  tokens[r, :num_tokens[r]]          prompt + output ids known on the host
            num_computed[r]                    tokens with K/V in the cache (incl. this step's)
            block_table[r, :num_blocks[r]]     its KV blocks
            temperature/top_p/min_p/top_k[r]   sampling parameters as columns (1.0 where greedy)
            greedy[r], num_logprobs[r] (-1: none), needs_edits[r] (bans, bias, allowed ids,
            grammar: the few rows the sampler's Python path looks at)
            last_sample[r]                     its row in the previous launch's sampled tokens

Rows are reused from a free list; the arrays double when more requests are live than rows.
"""

from __future__ import annotations

import numpy as np

from pagedllm.sampling_params import SamplingParams


class InputBatch:
    tokens: np.ndarray  # [R, max_model_len + 1] int32
    num_tokens: np.ndarray  # [R] int64
    num_computed: np.ndarray  # [R] int64
    block_table: np.ndarray  # [R, max_blocks] int32
    num_blocks: np.ndarray  # [R] int64
    temperature: np.ndarray  # [R] float32
    top_p: np.ndarray  # [R] float32
    min_p: np.ndarray  # [R] float32
    top_k: np.ndarray  # [R] float32 (vocab size where disabled)
    greedy: np.ndarray  # [R] bool
    num_logprobs: np.ndarray  # [R] int64
    needs_edits: np.ndarray  # [R] bool
    last_sample: np.ndarray  # [R] int64

    def __init__(self, max_model_len: int, block_size: int, vocab_size: int, capacity: int = 64) -> None:
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.capacity = 0
        self.free: list[int] = []
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.capacity

        def resize(name: str, shape: tuple, dtype, fill=0) -> None:
            a = np.full(shape, fill, dtype=dtype)
            if old:
                a[:old] = getattr(self, name)
            setattr(self, name, a)

        resize("tokens", (capacity, self.max_model_len + 1), np.int32)
        resize("num_tokens", (capacity,), np.int64)
        resize("num_computed", (capacity,), np.int64)
        resize("block_table", (capacity, self.max_blocks), np.int32)
        resize("num_blocks", (capacity,), np.int64)
        resize("temperature", (capacity,), np.float32, 1.0)
        resize("top_p", (capacity,), np.float32, 1.0)
        resize("min_p", (capacity,), np.float32)
        resize("top_k", (capacity,), np.float32)
        resize("greedy", (capacity,), np.bool_)
        resize("num_logprobs", (capacity,), np.int64, -1)
        resize("needs_edits", (capacity,), np.bool_)
        resize("last_sample", (capacity,), np.int64, -1)
        self.free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def add(
        self, token_ids: list[int], block_ids: list[int], num_computed: int, sp: SamplingParams, needs_edits: bool
    ) -> int:
        if not self.free:
            self._grow(2 * self.capacity)
        r = self.free.pop()
        n = len(token_ids)
        self.tokens[r, :n] = token_ids
        self.num_tokens[r] = n
        self.num_computed[r] = num_computed
        self.block_table[r, : len(block_ids)] = block_ids
        self.num_blocks[r] = len(block_ids)
        self.greedy[r] = sp.greedy
        self.temperature[r] = 1.0 if sp.greedy else sp.temperature
        self.top_p[r] = sp.top_p
        self.min_p[r] = sp.min_p
        self.top_k[r] = sp.top_k if sp.top_k > 0 else self.vocab_size
        self.num_logprobs[r] = -1 if sp.logprobs is None else sp.logprobs
        self.needs_edits[r] = needs_edits
        self.last_sample[r] = -1
        return r

    def remove(self, row: int) -> None:
        self.free.append(row)

    def add_blocks(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def add_tokens(self, row: int, token_ids: list[int]) -> None:
        n = self.num_tokens[row]
        self.tokens[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)

    def append_sampled(self, rows: np.ndarray, tokens: list[int]) -> None:
        """One sampled token for each of `rows` (distinct rows)."""
        self.tokens[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def decode_inputs(self, rows: np.ndarray, block_size: int, buf: np.ndarray) -> tuple[np.ndarray, int]:
        """A step of decodes only (one query token per row, every row samples): fills `buf`
        [3n + 2(n + 1) ...] as input_ids | positions | slots | query_start_loc | seq_lens |
        logits rows, and returns (the batch positions whose input token is the previous
        launch's sample, the widest block table)."""
        n = len(rows)
        c = self.num_computed[rows]
        known = c < self.num_tokens[rows]
        buf[:n] = np.where(known, self.tokens[rows, c], 0)
        buf[n : 2 * n] = c
        buf[2 * n : 3 * n] = self.block_table[rows, c // block_size].astype(np.int64) * block_size + c % block_size
        base = 3 * n
        buf[base : base + n + 1] = np.arange(n + 1)
        buf[base + n + 1 : base + 2 * n + 1] = c + 1
        buf[base + 2 * n + 1 : base + 3 * n + 1] = np.arange(n)
        pending = np.flatnonzero(~known)
        return pending, int(self.num_blocks[rows].max())
