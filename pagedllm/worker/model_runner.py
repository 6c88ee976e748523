"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It keeps each live request as a row of its InputBatch (worker/input_batch.py: tokens, block
table, sampling parameters, penalty histories on the device), changed by the scheduler's diffs
and by its own samples; gathers the step's ForwardBatch from those rows with numpy (decodes
first) into the device tensors the CUDA graphs read, runs the model, computes logits only at
the rows that need them, and samples (the sampling inputs: worker/sampling_inputs.py). Nothing
on this path loops over requests in Python but the rows that need it (bans, biases, grammars,
prompt logprobs).

Under asynchronous scheduling a decode's input token may be the previous launch's sample, not
yet read back: it is copied on the device. Penalties and `min_tokens` read nothing in flight
(the histories count every launched sample on the device; the output length is known).

Structured outputs (worker/grammar_step.py): each constrained request has a grammar matcher (a fresh one, fed the
request's output so far, whenever the request arrives in full: at its start and after a
preemption). A step's grammar work (`matcher.grammar_step`) feeds the matchers the tokens of the
launch not yet collected (asynchronous scheduling: it waits for that step only, which ran before
this one's forward pass) and fills the bitmask of this step's constrained rows. On CUDA it runs
on a thread of its own, submitted once the forward pass is queued, and the step's sampling is
deferred until the next `launch` or `collect` (`_finish_deferred`): the engine thread collects the
previous step, detokenizes and schedules meanwhile, and the device keeps running the forward
pass; the mask is on the device before the sampler that reads it.

    engine thread:  launch N: [finish N-1: join, sample] [inputs, forward N queued] submit ──┐
                    collect N-1, process, schedule N+1, launch N+1: [finish N: join ◀──┐  │
    grammar thread:                       wait N-1's tokens, accept them, fill N's mask ┘ ◀┘

Under pipeline parallelism every stage's runner builds the same batch from the same
SchedulerOutput; a stage past the first receives the previous stage's (hidden, residual) of
all the batch's tokens instead of embedding token ids, a stage before the last sends its own
on, and only the last computes logits and samples. The scheduler never puts a request into two
batches in flight at once, so the tokens it sampled reach every stage as
`CachedRequestData.new_token_ids` before they are needed:

    stage 0: recv -- | layers 0..k | send ──▶ stage 1: recv | layers k..n | norm, logits, sample
"""

from __future__ import annotations

from concurrent.futures import Future
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
    SamplingBatch,
    host_to_device,
    logprob_lists,
    logprob_tensors,
    sample,
)
from pagedllm.worker.grammar_step import GrammarSteps
from pagedllm.worker.input_batch import CachedRequestState, InputBatch, StepBuffers, aligned, int32_offsets
from pagedllm.worker.sampling_inputs import sampling_batch


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
        sc, max_len = config.scheduler_config, config.model_config.max_model_len
        self.input_batch = InputBatch(max_len, self.block_size, self.vocab_size, device, sc.max_num_seqs)
        # the device tensors the step's inputs are copied into (and the CUDA graphs read)
        self.buffers = (
            StepBuffers(
                max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs, self.input_batch.max_blocks, device
            )
            if device.type == "cuda"
            else None
        )
        self.graphs: Any = None  # DecodeGraphs over self.buffers, set by the worker on CUDA unless enforce_eager
        self._last_tokens: torch.Tensor | None = None  # [S] tokens of the latest launch that sampled
        self._uncollected: StepHandle | None = None  # the latest launch, until collected
        self.grammars = GrammarSteps(config, self.vocab_size, device, self.pin)  # structured outputs
        self._deferred: StepHandle | None = None  # the launch whose sampling waits for its grammar step

    # ---- request state ---------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for rid in so.finished_req_ids:
            gone = self.requests.pop(rid, None)
            if gone is not None:
                ib.remove(gone.row)
                if gone.grammar is not None:
                    self.grammars.release(gone.grammar)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)  # resumed after preemption: a fresh row
            if old is not None:
                ib.remove(old.row)
                if old.grammar is not None:
                    self.grammars.release(old.grammar)
            sp = new.sampling_params
            gen = old.generator if old is not None else None
            if gen is None and sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            python_edits = bool(
                sp.bad_words_token_ids or sp.logit_bias or sp.allowed_token_ids or sp.structured_outputs is not None
            )
            row = ib.add(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.block_ids,
                new.num_computed_tokens,
                sp,
                python_edits,
            )
            st = self.requests[new.req_id] = CachedRequestState(
                new.req_id, row, ib, new.num_prompt_tokens, sp, gen, new.eos_token_ids
            )
            if sp.structured_outputs is not None and self.ps.is_last_stage:  # (the last stage samples)
                st.grammar = self.grammars.new(sp.structured_outputs, st.token_ids[st.num_prompt_tokens :],
                                               st.eos_token_ids)  # fmt: skip
        cached = so.scheduled_cached_reqs
        if not cached:
            return
        requests = self.requests
        rows = [requests[c.req_id].row for c in cached]
        ib.num_computed[rows] = [c.num_computed_tokens for c in cached]
        for row, c in zip(rows, cached):
            if c.new_block_ids:
                ib.add_blocks(row, c.new_block_ids)
            if c.new_token_ids:  # pipeline parallelism: sampled by the last stage
                ib.add_tokens(row, c.new_token_ids)

    def _finish_deferred(self) -> None:
        """Queues the sampling of the launch that waited for its grammar step (joined here)."""
        h = self._deferred
        if h is None:
            return
        self._deferred = None
        assert h.pending is not None
        logits, sb, job = h.pending
        h.pending = None
        sb.edits.bitmask = self.grammars.join(job).to(self.device, non_blocking=True)
        self._sample(h, logits, sb)

    # ---- inputs ----------------------------------------------------------------------
    def _upload(self, host: np.ndarray, dst: torch.Tensor | None) -> torch.Tensor:
        """host (a numpy array) on the device: copied into the persistent `dst` [: len] on CUDA
        (through pinned memory, without waiting), the same memory on the CPU."""
        t = torch.from_numpy(host)
        if dst is None:
            return t
        dst = dst[: len(host)] if t.dim() == 1 else dst[: t.shape[0], : t.shape[1]]
        dst.copy_(t.pin_memory(), non_blocking=True)
        return dst

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's ForwardBatch, gathered from the InputBatch rows by numpy indexing (decodes
        first). All int64 inputs travel in one copy, the int32 ones in another, the block
        table rows in a third; a decode step that a CUDA graph will replay is laid out padded
        to the graph's batch size, in the tensors the graph reads."""
        ib = self.input_batch
        sched = so.num_scheduled_tokens
        num_reqs = len(sched)
        n_tok = so.total_num_scheduled_tokens
        requests = self.requests
        rows = np.fromiter((requests[r].row for r in sched), dtype=np.int64, count=num_reqs)
        n = np.fromiter(sched.values(), dtype=np.int64, count=num_reqs)
        num_decodes = int(np.count_nonzero(n == 1))
        if num_decodes < num_reqs:
            perm = np.argsort(n != 1, kind="stable")
            rows, n = rows[perm], n[perm]
        c = ib.num_computed[rows]
        seq_lens = c + n
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        if num_decodes == num_reqs:
            tok_rows, positions = rows, c
        else:
            tok_rows = np.repeat(rows, n)
            positions = np.repeat(c - qsl[:-1], n) + np.arange(n_tok)
        bs = self.block_size
        # a position not yet known on the host holds the token the launch in flight samples
        pending = np.flatnonzero(positions >= ib.num_tokens[tok_rows])
        src = ib.last_sample[tok_rows[pending]]
        assert (src >= 0).all(), "a decode's input token is neither known nor in flight"
        samples = seq_lens >= ib.num_tokens[rows]  # reaches the last known token (or the one in flight)
        logits_rows = qsl[1:][samples] - 1
        num_samples = len(logits_rows)
        prompt_rows: dict[str, tuple[int, int]] = {}
        plp = ib.prompt_logprobs[rows]
        if (plp >= 0).any():  # rows scored for prompt_logprobs follow the sampled ones
            npr = ib.num_prompt[rows]
            extra: list[int] = []
            for i in np.flatnonzero((plp >= 0) & (c < npr - 1)).tolist():
                cnt = int(min(seq_lens[i], npr[i] - 1) - c[i])
                prompt_rows[ib.req_ids[rows[i]]] = (num_samples + len(extra), cnt)
                extra.extend(range(int(qsl[i]), int(qsl[i]) + cnt))
            logits_rows = np.concatenate([logits_rows, np.asarray(extra, dtype=np.int64)])
        graph = self.graphs is not None and self.graphs.can_run(num_reqs, n_tok, num_decodes)
        padded = self.graphs.padded_size(num_reqs) if graph else n_tok
        stride = aligned(padded)  # of the token fields
        m, p = len(logits_rows), len(pending)
        # int64 (StepBuffers): input_ids | positions | slot_mapping (each `stride` apart) | logits rows
        ints = np.zeros(3 * stride + m, dtype=np.int64)
        ints[:n_tok] = ib.token_ids[tok_rows, positions]  # pending ones are filled in on the device
        ints[stride : stride + n_tok] = positions
        slots = ints[2 * stride : 2 * stride + padded]
        slots[:n_tok] = ib.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        slots[n_tok:] = -1  # graph padding: nothing stored
        base = 3 * stride
        ints[base:] = logits_rows
        # int32: query_start_loc | seq_lens | pending tokens | their rows in the latest
        # launch's samples; rs = the batch size, padded to the graph's
        rs = padded if graph else num_reqs
        lens_at, pend = int32_offsets(rs)
        i32 = np.zeros(pend + aligned(p) + p, dtype=np.int32)
        if graph:
            i32[: rs + 1] = np.arange(rs + 1)
        else:
            i32[: num_reqs + 1] = qsl
        i32[lens_at : lens_at + num_reqs] = seq_lens
        i32[pend : pend + p] = pending
        i32[pend + aligned(p) :] = src
        max_blocks = max(1, int(ib.num_blocks[rows].max()))
        tables = ib.block_table[rows, :max_blocks]
        buf = self.buffers
        d_ints = self._upload(ints, buf.ints if buf is not None else None)
        d_i32 = self._upload(i32, buf.ints32 if buf is not None else None)
        d_tables = self._upload(tables, buf.block_tables if buf is not None else None)
        if p:
            assert self._last_tokens is not None
            src_at = pend + aligned(p)
            d_ints[d_i32[pend : pend + p]] = self._last_tokens[d_i32[src_at : src_at + p]]
        batch = ForwardBatch(
            input_ids=d_ints[:n_tok],
            positions=d_ints[stride : stride + n_tok],
            slot_mapping=d_ints[2 * stride : 2 * stride + n_tok],
            query_start_loc=d_i32[: num_reqs + 1],
            seq_lens=d_i32[lens_at : lens_at + num_reqs],
            block_tables=d_tables,
            logits_indices=d_ints[base : base + m],
            num_decodes=num_decodes,
            max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=n.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return StepInputs(batch, rows, n, rows[samples], prompt_rows, graph)

    # ---- one step --------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> StepHandle:
        """Queues the step's work on the device and returns without waiting for it. A decode
        whose input token was sampled by the previous launch (not yet collected) reads that
        token on the device."""
        self._finish_deferred()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return StepHandle()
        si = self.prepare_inputs(so)
        batch = si.batch
        if not si.graph:
            batch.attn_metadata = self.backend.build_metadata(batch, self.block_size)
        ib = self.input_batch
        if si.graph:
            # the graph's own output buffer, which the next launch overwrites: everything read
            # from it (sampling, logprobs) is queued below, before that launch
            logits = self.graphs.run(batch.num_reqs, batch.max_seq_len)  # [n, V], row i is token i
            if batch.logits_indices.shape[0] != batch.num_tokens or len(si.sample_rows) != batch.num_reqs:
                logits = logits[batch.logits_indices]  # [S', V]
        elif self.ps.pp_size > 1:
            logits = self._run_stage(batch, so.total_num_scheduled_tokens)
            if logits is None:  # not the last stage: its part is done once the hidden states are sent
                ib.num_computed[si.rows] += si.num_scheduled
                return StepHandle()
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch)
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S', V] (the head's dtype)
        h = StepHandle()
        if si.prompt_rows:
            # queued now, before the next launch can overwrite a CUDA graph's output buffer
            h.prompt_logprobs = self._prompt_logprobs(logits, si.prompt_rows)
        ib.num_computed[si.rows] += si.num_scheduled
        srows = si.sample_rows
        if len(srows):
            req_ids = ib.req_ids[srows].tolist()
            reqs = [self.requests[r] for r in req_ids]
            rows = logits if len(srows) == logits.shape[0] else logits[: len(srows)]  # sampled rows come first
            sb, grammar_rows = sampling_batch(ib, reqs, srows, self.vocab_size, self.device)
            h.states = reqs
            h.req_ids = req_ids
            h.rows = srows
            h.gens = ib.gen[srows]
            h.grammar_rows = grammar_rows
            ib.last_sample[srows] = np.arange(len(srows))
            if grammar_rows:
                job = self.grammars.start(self._uncollected, [reqs[i].grammar for i in grammar_rows])
                if isinstance(job, Future):
                    # sampled at the next launch or collect; the prompt logprobs' copies are
                    # already queued, so they get their own event now
                    h.pending = (rows, sb, job)
                    self._deferred = h
                    self._uncollected = h
                    if self.device.type == "cuda" and h.prompt_logprobs:
                        h.ready = torch.cuda.Event()
                        h.ready.record()
                    return h
                sb.edits.bitmask = job.to(self.device, non_blocking=True)
            self._sample(h, rows, sb)
            return h
        if self.device.type == "cuda" and h.prompt_logprobs:
            h.ready = torch.cuda.Event()
            h.ready.record()
        return h

    def _sample(self, h: StepHandle, logits: torch.Tensor, sb: SamplingBatch) -> None:
        """Queues the sampling of launch `h` from its logits rows, the logprobs and the copies
        `collect` reads, behind one event."""
        ib = self.input_batch
        h.tokens = sample(logits, sb, self.generator)
        if sb.history_rows is not None:
            ib.count_samples(sb.history_rows, h.tokens)
        if any(k is not None for k in sb.num_logprobs):
            lt = logprob_tensors(logits, h.tokens, sb.num_logprobs)
            h.logprobs = lt.to_host() if lt is not None else None
        if self.device.type == "cuda":
            h.tokens_host = torch.empty(h.tokens.shape, dtype=h.tokens.dtype, pin_memory=True)
            h.tokens_host.copy_(h.tokens, non_blocking=True)
            # everything `collect` reads comes back through pinned memory behind an event
            # recorded now: it then waits for this step only, not for the next one launched
            # after it on the stream
            h.ready = torch.cuda.Event()
            h.ready.record()
        self._last_tokens = h.tokens
        self._uncollected = h

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
        return self.model.compute_logits(out[batch.logits_indices])

    @torch.inference_mode()
    def collect(self, h: StepHandle) -> ModelRunnerOutput:
        """Waits for a launched step and returns its tokens (and logprobs)."""
        out = ModelRunnerOutput()
        if h.pending is not None:
            assert h is self._deferred
            self._finish_deferred()
        if h.ready is not None:
            h.ready.synchronize()
        for rid, lt in (h.prompt_logprobs or {}).items():
            out.prompt_logprobs[rid] = logprob_lists(lt, len(lt.num))  # type: ignore[assignment]
        if h.tokens is None:
            return out
        if h is self._uncollected:
            self._uncollected = None
        tokens_np = (h.tokens_host if h.tokens_host is not None else h.tokens).numpy()
        tokens = tokens_np.tolist()
        if self.ps.pp_size == 1:  # else they come back as new_token_ids
            assert h.rows is not None and h.gens is not None
            self.input_batch.append_sampled(h.rows, h.gens, tokens_np)
        req_ids = h.req_ids or []
        out.sampled_token_ids = dict(zip(req_ids, tokens))
        if h.logprobs is not None:
            for rid, lp in zip(req_ids, logprob_lists(h.logprobs, len(tokens))):
                if lp is not None:
                    out.logprobs[rid] = lp
        if h.grammar_rows and not h.grammar_accepted:
            assert h.states is not None
            self.grammars.accept([h.states[i].grammar for i in h.grammar_rows], [tokens[i] for i in h.grammar_rows])
            h.grammar_accepted = True
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
    req_ids: list[str] | None = None  # their ids
    rows: np.ndarray | None = None  # [S] their InputBatch rows
    gens: np.ndarray | None = None  # [S] those rows' `gen` at launch (a row since reused is not written back)
    logprobs: LogprobTensors | None = None  # of the sampled rows that asked (host copies on CUDA)
    prompt_logprobs: dict[str, LogprobTensors] | None = None  # per request with prompt_logprobs
    grammar_rows: list[int] | None = None  # indices (into states) of the rows with a grammar
    grammar_accepted: bool = False  # its tokens are in the matchers, or a grammar step owns them
    pending: tuple[torch.Tensor, SamplingBatch, Future] | None = None  # logits rows, inputs, grammar step


@dataclass(slots=True)
class StepInputs:
    """What prepare_inputs gives launch."""

    batch: ForwardBatch
    rows: np.ndarray  # [B] InputBatch rows, in the batch's order
    num_scheduled: np.ndarray  # [B] tokens of each this step
    sample_rows: np.ndarray  # [S] the rows that sample, in order (their logits rows come first)
    prompt_rows: dict[str, tuple[int, int]]  # prompt_logprobs: request -> (first logits row, count)
    graph: bool  # a CUDA graph replays the forward pass
