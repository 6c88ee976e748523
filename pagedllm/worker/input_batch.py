"""InputBatch: the runner's per-request rows, kept across steps and changed only where a
request joins, leaves, gains blocks or gains tokens; CachedRequestState: a live request's
facts that are not rows (and views of those that are); StepBuffers: the device tensors every
step's inputs are copied into (the CUDA graphs read the same ones).

A step's inputs are gathered from the rows with numpy indexing by row, never by a Python loop
over requests:

    row r:  token_ids[r, :num_tokens[r]]      prompt + output ids known on the host
            num_computed[r], num_prompt[r]     tokens with K/V in the cache (incl. launched ones)
            block_table[r, :num_blocks[r]]     its KV blocks
            cols[r, :]                         sampling parameters as columns (COLS)
            num_logprobs[r], prompt_logprobs[r], min_tokens[r]   (-1 / 0 where off)
            python_edits[r]                    bad words, logit_bias, allowed ids or a grammar:
                                               the few rows the sampler's Python path reads
            last_sample[r]                     its row in the latest launch's sampled tokens
            gen[r]                             bumped each time the row is given up
    on the device, once a request with penalties joins:
            output_counts[r, v]                how often token v is in the output (all launched
                                               samples, updated on the device after sampling)
            prompt_mask[r, v]                  token v is in the prompt (repetition penalty)

Rows come from a free list and the arrays double when more requests are live than rows. A row
can be given to a new request while a launch that sampled for its old request is still in
flight (the old one finished or was aborted meanwhile): `collect` writes back only into rows
whose `gen` is still the one it launched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams

# the float32 sampling columns, in order: 1.0 temperature where greedy; top_k = vocab where off
COLS = ("temperature", "top_p", "min_p", "top_k", "greedy", "presence", "frequency", "repetition")
(TEMPERATURE, TOP_P, MIN_P, TOP_K, GREEDY, PRESENCE, FREQUENCY, REPETITION) = range(len(COLS))


def has_penalties(sp: SamplingParams) -> bool:
    return sp.repetition_penalty != 1.0 or bool(sp.frequency_penalty) or bool(sp.presence_penalty)


class InputBatch:
    # the rows (module docstring), resized together by _grow
    token_ids: np.ndarray  # [capacity, max_model_len + 1] int32
    num_tokens: np.ndarray  # [capacity] int64
    num_computed: np.ndarray
    num_prompt: np.ndarray
    block_table: np.ndarray  # [capacity, max_blocks] int32
    num_blocks: np.ndarray
    cols: np.ndarray  # [capacity, len(COLS)] float32
    num_logprobs: np.ndarray
    prompt_logprobs: np.ndarray
    min_tokens: np.ndarray
    python_edits: np.ndarray  # bool
    seeded: np.ndarray  # bool: has its own generator
    last_sample: np.ndarray
    gen: np.ndarray
    req_ids: np.ndarray  # object: the request id of each row, None where free

    def __init__(
        self, max_model_len: int, block_size: int, vocab_size: int, device: torch.device, capacity: int = 64
    ) -> None:
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = 0
        self.free: list[int] = []
        self.output_counts: torch.Tensor | None = None  # [capacity, V] int32, made with the first penalty
        self.prompt_mask: torch.Tensor | None = None  # [capacity, V] bool
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.capacity

        def resize(name: str, shape: tuple, dtype: Any, fill: Any = 0) -> None:
            a = np.zeros(shape, dtype=dtype) if fill == 0 else np.full(shape, fill, dtype=dtype)
            if old:
                a[:old] = getattr(self, name)
            setattr(self, name, a)

        resize("token_ids", (capacity, self.max_model_len + 1), np.int32)
        resize("num_tokens", (capacity,), np.int64)
        resize("num_computed", (capacity,), np.int64)
        resize("num_prompt", (capacity,), np.int64)
        resize("block_table", (capacity, self.max_blocks), np.int32)
        resize("num_blocks", (capacity,), np.int64)
        resize("cols", (capacity, len(COLS)), np.float32)
        resize("num_logprobs", (capacity,), np.int64, -1)
        resize("prompt_logprobs", (capacity,), np.int64, -1)
        resize("min_tokens", (capacity,), np.int64)
        resize("python_edits", (capacity,), np.bool_)
        resize("seeded", (capacity,), np.bool_)
        resize("last_sample", (capacity,), np.int64, -1)
        resize("gen", (capacity,), np.int64)
        resize("req_ids", (capacity,), object, None)
        if self.output_counts is not None:
            self.output_counts, self.prompt_mask = self._device_rows(capacity)
        self.free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def _device_rows(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.output_counts is not None and self.prompt_mask is not None:
            n = self.output_counts.shape[0]
            counts[:n] = self.output_counts
            mask[:n] = self.prompt_mask
        return counts, mask

    # ---- rows join, leave, grow ------------------------------------------------------------
    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt: int,
        block_ids: list[int],
        num_computed: int,
        sp: SamplingParams,
        python_edits: bool,
    ) -> int:
        if not self.free:
            self._grow(2 * self.capacity)
        r = self.free.pop()
        n = len(token_ids)
        self.token_ids[r, :n] = token_ids
        self.num_tokens[r] = n
        self.num_computed[r] = num_computed
        self.num_prompt[r] = num_prompt
        self.block_table[r, : len(block_ids)] = block_ids
        self.num_blocks[r] = len(block_ids)
        c = self.cols[r]
        c[TEMPERATURE] = 1.0 if sp.greedy else sp.temperature
        c[TOP_P] = sp.top_p
        c[MIN_P] = sp.min_p
        c[TOP_K] = sp.top_k if sp.top_k > 0 else self.vocab_size
        c[GREEDY] = sp.greedy
        c[PRESENCE] = sp.presence_penalty
        c[FREQUENCY] = sp.frequency_penalty
        c[REPETITION] = sp.repetition_penalty
        self.num_logprobs[r] = -1 if sp.logprobs is None else sp.logprobs
        self.prompt_logprobs[r] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.min_tokens[r] = sp.min_tokens
        self.python_edits[r] = python_edits
        self.seeded[r] = sp.seed is not None
        self.last_sample[r] = -1
        self.req_ids[r] = req_id
        if has_penalties(sp):
            self._set_history(r, token_ids, num_prompt)
        return r

    def _set_history(self, r: int, token_ids: list[int], num_prompt: int) -> None:
        """The row's penalty history from its known tokens (queued on the device, after every
        update an earlier launch queued for the row's previous request)."""
        if self.output_counts is None:
            self.output_counts, self.prompt_mask = self._device_rows(self.capacity)
        assert self.prompt_mask is not None
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        self.prompt_mask[r] = False
        self.prompt_mask[r, ids[:num_prompt]] = True
        self.output_counts[r] = 0
        out = ids[num_prompt:]
        if out.numel():
            self.output_counts[r].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def remove(self, row: int) -> None:
        self.req_ids[row] = None
        self.gen[row] += 1
        self.free.append(row)

    def add_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        n = self.num_blocks[row]
        self.block_table[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def add_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)

    def append_sampled(self, rows: np.ndarray, gens: np.ndarray, tokens: np.ndarray) -> None:
        """One sampled token for each of `rows` (distinct rows) that still holds the request
        it was launched for (`gens`)."""
        live = self.gen[rows] == gens
        if not live.all():
            rows, tokens = rows[live], tokens[live]
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def count_samples(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The penalty history gains this step's samples (on the device, no wait): rows [S]
        int64, tokens [S] int64. Rows of requests without penalties count too, unread."""
        assert self.output_counts is not None
        self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


@dataclass(slots=True)
class CachedRequestState:
    """A live request's facts that are not rows of the InputBatch (and views of those that are)."""

    req_id: str
    row: int  # its row in the runner's InputBatch
    batch: InputBatch
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]
    grammar: Any = None  # structured outputs: its matcher (a RequestGrammar, or a GrammarPool's RemoteGrammar)

    @property
    def token_ids(self) -> list[int]:
        """The ids known on the host (a copy; under asynchronous scheduling one may be in flight)."""
        b = self.batch
        return b.token_ids[self.row, : b.num_tokens[self.row]].tolist()

    @property
    def num_computed_tokens(self) -> int:
        return int(self.batch.num_computed[self.row])


def aligned(n: int) -> int:
    """n rounded up to 4 elements: each field of StepBuffers starts 16-byte aligned (Triton
    specializes a kernel on its pointers' alignment; an odd offset would compile another
    variant in the middle of a run)."""
    return -(-n // 4) * 4


def int32_offsets(rs: int) -> tuple[int, int]:
    """Where seq_lens and the pending decodes start in StepBuffers.ints32, for rs requests."""
    return aligned(rs + 1), aligned(rs + 1) + aligned(rs)


class StepBuffers:
    """The device tensors a step's inputs are copied into, one copy per dtype. Offsets depend
    on the step's size, so that a CUDA graph of batch size B reads fixed addresses: a decode
    step padded to B lays out, with S = aligned(B) and (L, P) = int32_offsets(B),

        ints  int64: input_ids [0, B) | positions [S, S+B) | slot_mapping [2S, 2S+B) | logits rows [3S, ...)
        ints32 int32: query_start_loc [0, B+1) | seq_lens [L, L+B) | from P: the decodes whose
                      token is in flight, then that token's row in the latest launch's samples
        block_tables int32 [max_reqs, max_blocks]: rows [0, B), columns as wide as the step needs

    (an eager step of T tokens and n requests: B = T for the int64 fields, n for the int32 ones)."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        self.ints = torch.zeros(4 * aligned(max_tokens), dtype=torch.int64, device=device)
        self.ints32 = torch.zeros(4 * aligned(max_reqs + 1), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
