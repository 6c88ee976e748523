"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It keeps a copy of each live request's tokens and block table (updated from the scheduler's
diffs and from its own samples), builds the ForwardBatch (decodes first), runs the model,
computes logits only at the rows that need them, and samples.

Structured outputs: each constrained request has a grammar matcher here (a fresh one, fed the
request's output so far, whenever the request arrives in full: at its start and after a
preemption). A step's constrained rows get their bitmask filled on the host after the forward
pass is queued; under asynchronous scheduling the previous step's tokens are first accepted
into the matchers (one wait for that step, which ran before this one's forward: the device
stays busy meanwhile).

Under pipeline parallelism every stage's runner builds the same batch from the same
SchedulerOutput; a stage past the first receives the previous stage's (hidden, residual) of
all the batch's tokens instead of embedding token ids, a stage before the last sends its own
on, and only the last computes logits and samples. The scheduler never puts a request into two
batches in flight at once, so the tokens it sampled reach every stage as
`CachedRequestData.new_token_ids` before they are needed:

    stage 0: recv -- | layers 0..k | send ──▶ stage 1: recv | layers k..n | norm, logits, sample
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, ForwardBatch
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.sampler import (
    LogprobTensors,
    host_to_device,
    logprob_lists,
    logprob_tensors,
    sample,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.matcher import RequestGrammar, new_matcher
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.sampling_inputs import sampling_batch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    table_np: np.ndarray  # block_ids as an array, refreshed when blocks are added
    eos_token_ids: frozenset[int]
    row: int  # its row in the InputBatch
    grammar: RequestGrammar | None = None  # structured outputs: the matcher of its output


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        backend: AttentionBackend,
        device: torch.device,
        ps: ParallelState = SINGLE,
    ):
        self.config = config
        self.ps = ps
        self.hidden_size = config.model_config.hf_config.hidden_size
        self.act_dtype = next(model.parameters()).dtype
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.generator = torch.Generator(device=device).manual_seed(config.model_config.seed)
        self.pin = device.type == "cuda"
        self.graphs: Any = None  # DecodeGraphs, set by the worker on CUDA unless enforce_eager
        self._last_tokens: torch.Tensor | None = None  # [S] tokens of the latest launch
        self.batch = InputBatch(config.model_config.max_model_len, self.block_size, self.vocab_size)
        self._uncollected: StepHandle | None = None  # the latest launch, until collected
        self._structured: Any = None  # StructuredOutputManager, only where grammars arrive uncompiled

    # ---- request state ---------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for rid in so.finished_req_ids:
            gone = self.requests.pop(rid, None)
            if gone is not None:
                batch.remove(gone.row)
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            gen = old.generator if old is not None else None
            if old is not None:
                batch.remove(old.row)
            sp = new.sampling_params
            if gen is None and sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            edits = bool(
                sp.min_tokens
                or sp.bad_words_token_ids
                or sp.logit_bias
                or sp.allowed_token_ids
                or sp.structured_outputs is not None
            )
            row = batch.add(new.token_ids, new.block_ids, new.num_computed_tokens, sp, edits)
            st = self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.token_ids),
                new.num_prompt_tokens,
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
                gen,
                np.asarray(new.block_ids, dtype=np.int64),
                new.eos_token_ids,
                row,
            )
            if new.sampling_params.structured_outputs is not None and self.ps.is_last_stage:
                st.grammar = self._new_grammar(st)  # (only the last pipeline stage samples)
        for c in so.scheduled_cached_reqs:
            st = self.requests[c.req_id]
            if c.new_block_ids:
                st.block_ids.extend(c.new_block_ids)
                st.table_np = np.asarray(st.block_ids, dtype=np.int64)
                batch.add_blocks(st.row, c.new_block_ids)
            if c.new_token_ids:  # pipeline parallelism: sampled by the last stage
                st.token_ids.extend(c.new_token_ids)
                batch.add_tokens(st.row, c.new_token_ids)
            st.num_computed_tokens = c.num_computed_tokens
            batch.num_computed[st.row] = c.num_computed_tokens

    def _new_grammar(self, st: CachedRequestState) -> RequestGrammar:
        so = st.sampling_params.structured_outputs
        assert so is not None
        compiled = so.compiled
        if compiled is None:  # a worker in another process than the engine: compile here
            if self._structured is None:
                from pagedllm.model.loader import load_tokenizer
                from pagedllm.structured_output.manager import StructuredOutputManager

                mc = self.config.model_config
                tok = load_tokenizer(mc.model, mc.tokenizer, mc.gguf_file)
                self._structured = StructuredOutputManager(tok, self.vocab_size, st.eos_token_ids)
            compiled = self._structured.compile(so)
        return RequestGrammar(new_matcher(compiled), st.token_ids[st.num_prompt_tokens :])

    def _accept_uncollected(self) -> None:
        """Feeds the matchers the tokens of the launch not yet collected (asynchronous
        scheduling), so that this step's masks follow them."""
        h = self._uncollected
        if h is None or h.tokens is None or h.grammar_accepted:
            return
        if h.ready is not None:
            h.ready.synchronize()
        tokens = (h.tokens_host if h.tokens_host is not None else h.tokens).tolist()
        for st, t in zip(h.states or (), tokens):
            if st.grammar is not None:
                st.grammar.accept(t)
        h.grammar_accepted = True

    # ---- inputs ----------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.device.type == "cpu":
            return t
        if self.pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def prepare_inputs(self, so: SchedulerOutput):
        """Returns the batch, the request order, the requests that sample this step with their
        logits rows, and for prompt-logprob requests the (first logits row, count) of their
        chunk. All integer inputs travel to the device in one copy."""
        sched = so.num_scheduled_tokens
        if so.num_decodes == len(sched) and so.total_num_scheduled_tokens == len(sched):
            return self._decode_inputs(so)
        order = sorted(sched, key=lambda r: sched[r] != 1)
        num_reqs = len(order)
        bs = self.block_size
        n_tok = so.total_num_scheduled_tokens
        # one int64 buffer: input_ids | positions | slots | query_start_loc | seq_lens | (logits rows)
        buf = np.empty(3 * n_tok + 2 * num_reqs + 1, dtype=np.int64)
        input_ids, positions, slots = buf[:n_tok], buf[n_tok : 2 * n_tok], buf[2 * n_tok : 3 * n_tok]
        qsl = buf[3 * n_tok : 3 * n_tok + num_reqs + 1]
        seq_lens_np = buf[3 * n_tok + num_reqs + 1 :]
        seq_lens, query_lens = [0] * num_reqs, [0] * num_reqs
        max_blocks = 1
        logits_rows: list[int] = []
        sampling: list[str] = []
        sample_rows: list[int] = []
        prompt_rows: dict[str, tuple[int, int]] = {}
        num_decodes = 0
        pending: list[tuple[int, int]] = []  # (input row, row of the previous launch's tokens)
        s = 0
        qsl[0] = 0
        requests = self.requests
        for i, rid in enumerate(order):
            st = requests[rid]
            n = sched[rid]
            c = st.num_computed_tokens
            if n == 1:
                num_decodes += 1
                if c < len(st.token_ids):
                    input_ids[s] = st.token_ids[c]
                else:  # sampled by the launch still in flight: filled in on the device
                    input_ids[s] = 0
                    pending.append((s, int(self.batch.last_sample[st.row])))
                positions[s] = c
                slots[s] = st.block_ids[c // bs] * bs + c % bs
            else:
                input_ids[s : s + n] = st.token_ids[c : c + n]
                pos = np.arange(c, c + n)
                positions[s : s + n] = pos
                slots[s : s + n] = st.table_np[pos // bs] * bs + pos % bs
            seq_lens[i] = c + n
            query_lens[i] = n
            if len(st.block_ids) > max_blocks:
                max_blocks = len(st.block_ids)
            if st.sampling_params.prompt_logprobs is not None and c < st.num_prompt_tokens - 1:
                cnt = min(c + n, st.num_prompt_tokens - 1) - c
                prompt_rows[rid] = (len(logits_rows), cnt)
                logits_rows.extend(range(s, s + cnt))
            s += n
            qsl[i + 1] = s
            if c + n >= len(st.token_ids):  # reaches the last token (or the one in flight)
                sampling.append(rid)
                sample_rows.append(len(logits_rows))
                logits_rows.append(s - 1)
        seq_lens_np[:] = seq_lens
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, rid in enumerate(order):
            t = requests[rid].table_np
            block_tables[i, : len(t)] = t
        ints = self._to_device(np.concatenate([buf, np.asarray(logits_rows, dtype=np.int64)]))
        if pending:
            dst, src = zip(*pending)
            idx = self._to_device(np.array([dst, src], dtype=np.int64))
            assert self._last_tokens is not None
            ints[idx[0]] = self._last_tokens[idx[1]]
        base = 3 * n_tok
        batch = ForwardBatch(
            input_ids=ints[:n_tok],
            positions=ints[n_tok : 2 * n_tok],
            slot_mapping=ints[2 * n_tok : base],
            query_start_loc=ints[base : base + num_reqs + 1].to(torch.int32),
            seq_lens=ints[base + num_reqs + 1 : base + 2 * num_reqs + 1].to(torch.int32),
            block_tables=self._to_device(block_tables),
            logits_indices=ints[base + 2 * num_reqs + 1 :],
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return batch, order, sampling, sample_rows, prompt_rows

    def _decode_inputs(self, so: SchedulerOutput):
        """prepare_inputs of a step of decodes only (the common step): gathered from the
        InputBatch's rows; every request samples, none scores its prompt."""
        order = list(so.num_scheduled_tokens)
        n = len(order)
        rows = np.fromiter((self.requests[r].row for r in order), dtype=np.int64, count=n)
        buf = np.empty(6 * n + 1, dtype=np.int64)
        pending, max_blocks = self.batch.decode_inputs(rows, self.block_size, buf)
        ints = self._to_device(buf)
        if len(pending):
            assert self._last_tokens is not None
            src = self.batch.last_sample[rows[pending]]
            idx = self._to_device(np.stack([pending.astype(np.int64), src]))
            ints[idx[0]] = self._last_tokens[idx[1]]
        seq_lens = (buf[4 * n + 1 : 5 * n + 1]).tolist()
        batch = ForwardBatch(
            input_ids=ints[:n],
            positions=ints[n : 2 * n],
            slot_mapping=ints[2 * n : 3 * n],
            query_start_loc=ints[3 * n : 4 * n + 1].to(torch.int32),
            seq_lens=ints[4 * n + 1 : 5 * n + 1].to(torch.int32),
            block_tables=self._to_device(self.batch.block_table[rows, :max_blocks]),
            logits_indices=ints[5 * n + 1 :],
            num_decodes=n,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens,
        )
        return batch, order, order, list(range(n)), {}

    # ---- one step --------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> StepHandle:
        """Queues the step's work on the device and returns without waiting for it. A decode
        whose input token was sampled by the previous launch (not yet collected) reads that
        token on the device."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle()
        batch, order, sampling, sample_rows, prompt_rows = self.prepare_inputs(so)
        if self.graphs is not None and self.graphs.can_run(batch):
            # the graph's own output buffer, which the next launch overwrites: everything read
            # from it (sampling, logprobs) is queued below, before that launch
            logits = self.graphs.run(batch)  # [n, V], row i is token i
            if batch.logits_indices.shape[0] != batch.num_tokens:  # else the rows are 0..n-1
                logits = logits[batch.logits_indices]  # [S', V]
        elif self.ps.pp_size > 1:
            logits = self._run_stage(batch, so.total_num_scheduled_tokens)
            if logits is None:  # not the last stage: its part is done once the hidden states are sent
                self._advance(order, so)
                return StepHandle()
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch)
            logits = self.model.compute_logits(hidden[batch.logits_indices]).float()  # [S', V]
        h = StepHandle()
        if prompt_rows:
            # queued now, before the next launch can overwrite a CUDA graph's output buffer
            h.prompt_logprobs = self._prompt_logprobs(logits, prompt_rows)
        self._advance(order, so)
        if sampling:
            reqs = [self.requests[r] for r in sampling]
            srows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
            rows = (
                logits
                if len(sample_rows) == logits.shape[0]
                else logits[self._to_device(np.asarray(sample_rows, dtype=np.int64))]
            )
            sb = sampling_batch(self, reqs, srows)
            h.tokens = sample(rows, sb, self.generator)
            lt = logprob_tensors(rows, h.tokens, sb.num_logprobs)
            h.logprobs = lt.to_host() if lt is not None else None
            if self.device.type == "cuda":
                h.tokens_host = torch.empty(h.tokens.shape, dtype=h.tokens.dtype, pin_memory=True)
                h.tokens_host.copy_(h.tokens, non_blocking=True)
            h.states = reqs
            h.rows = srows
            self._last_tokens = h.tokens
            self.batch.last_sample[srows] = np.arange(len(reqs))
            self._uncollected = h
        if self.device.type == "cuda" and (h.tokens is not None or h.prompt_logprobs):
            # everything `collect` reads comes back through pinned memory behind an event
            # recorded now: it then waits for this step only, not for the next one launched
            # after it on the stream
            h.ready = torch.cuda.Event()
            h.ready.record()
        return h

    def _advance(self, order: list[str], so: SchedulerOutput) -> None:
        """The step's tokens are computed (their K/V is being written)."""
        sched = so.num_scheduled_tokens
        ib = self.batch
        for rid in order:
            st = self.requests[rid]
            st.num_computed_tokens += sched[rid]
            ib.num_computed[st.row] = st.num_computed_tokens

    def _run_stage(self, batch: ForwardBatch, n_tok: int) -> torch.Tensor | None:
        """This pipeline stage's layers: the logits [S', V] on the last stage, else None (the
        hidden states went on to the next stage)."""
        ps = self.ps
        intermediate = None
        if not ps.is_first_stage:
            # hidden [T, H] and residual [T, H] of the batch's T tokens
            intermediate = tuple(
                torch.empty((n_tok, self.hidden_size), dtype=self.act_dtype, device=self.device) for _ in range(2)
            )
            ps.recv_from_prev_stage(list(intermediate))
        out = self.model(batch.input_ids, batch.positions, batch, intermediate)
        if not ps.is_last_stage:
            ps.send_to_next_stage(list(out))
            return None
        return self.model.compute_logits(out[batch.logits_indices]).float()

    @torch.inference_mode()
    def collect(self, h: StepHandle) -> ModelRunnerOutput:
        """Waits for a launched step and returns its tokens (and logprobs)."""
        out = ModelRunnerOutput()
        if h.ready is not None:
            h.ready.synchronize()
        for rid, lt in (h.prompt_logprobs or {}).items():
            out.prompt_logprobs[rid] = logprob_lists(lt, len(lt.num))  # type: ignore[assignment]
        if h.tokens is None:
            return out
        if h is self._uncollected:
            self._uncollected = None
        tokens = (h.tokens_host if h.tokens_host is not None else h.tokens).tolist()
        lps = logprob_lists(h.logprobs, len(tokens)) if h.logprobs is not None else None
        accept = not h.grammar_accepted
        own_tokens = self.ps.pp_size == 1  # else they come back as new_token_ids
        if own_tokens and h.rows is not None:
            self.batch.append_sampled(h.rows, tokens)
        for i, (r, t) in enumerate(zip(h.states or (), tokens)):
            if own_tokens:
                r.token_ids.append(t)
            if accept and r.grammar is not None:
                r.grammar.accept(t)
            out.sampled_token_ids[r.req_id] = t
            lp = lps[i] if lps is not None else None
            if lp is not None:
                out.logprobs[r.req_id] = lp
        return out

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: dict[str, tuple[int, int]]) -> dict:
        """Row j of a chunk starting at position c scores prompt token c + j + 1; queued on the
        device, copied to the host without waiting."""
        res = {}
        for rid, (start, cnt) in prompt_rows.items():
            st = self.requests[rid]
            c = st.num_computed_tokens
            targets = host_to_device(st.token_ids[c + 1 : c + 1 + cnt], torch.int64, logits.device)
            k = st.sampling_params.prompt_logprobs
            lt = logprob_tensors(logits[start : start + cnt], targets, [k] * cnt)
            assert lt is not None
            res[rid] = lt.to_host()
        return res


@dataclass(slots=True)
class StepHandle:
    """A launched step: device tensors to read back in `collect`."""

    tokens: torch.Tensor | None = None  # [S] sampled token ids
    tokens_host: torch.Tensor | None = None  # [S] pinned host copy (CUDA), valid once `ready`
    ready: torch.cuda.Event | None = None  # recorded after every copy to the host (tokens, logprobs)
    states: list[CachedRequestState] | None = None  # the sampling requests, in row order
    rows: np.ndarray | None = None  # [S] their InputBatch rows
    logprobs: LogprobTensors | None = None  # of the sampled rows that asked (host copies on CUDA)
    prompt_logprobs: dict[str, LogprobTensors] | None = None  # per request with prompt_logprobs
    grammar_accepted: bool = False  # its tokens are already in the matchers (read by the next launch)
