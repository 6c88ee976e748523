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
from pagedllm.model.logits_processors import LogitsEdits, banned_tail_tokens
from pagedllm.model.sampler import (
    LogprobTensors,
    SamplingBatch,
    host_to_device,
    logprob_lists,
    logprob_tensors,
    sample,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.matcher import RequestGrammar, fill_bitmask, new_matcher

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
        self._last_rows: dict[str, int] = {}  # request id -> row in _last_tokens
        self._uncollected: StepHandle | None = None  # the latest launch, until collected
        self._structured: Any = None  # StructuredOutputManager, only where grammars arrive uncompiled

    # ---- request state ---------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            old = self.requests.get(new.req_id)
            gen = old.generator if old is not None else None
            if gen is None and new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
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
            )
            if new.sampling_params.structured_outputs is not None and self.ps.is_last_stage:
                st.grammar = self._new_grammar(st)  # (only the last pipeline stage samples)
        for c in so.scheduled_cached_reqs:
            st = self.requests[c.req_id]
            if c.new_block_ids:
                st.block_ids.extend(c.new_block_ids)
                st.table_np = np.asarray(st.block_ids, dtype=np.int64)
            if c.new_token_ids:  # pipeline parallelism: sampled by the last stage
                st.token_ids.extend(c.new_token_ids)
            st.num_computed_tokens = c.num_computed_tokens

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
                    pending.append((s, self._last_rows[rid]))
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

    def _sampling_batch(self, reqs: list[CachedRequestState]) -> SamplingBatch:
        sps = [r.sampling_params for r in reqs]
        dev = self.device

        def col(values, dtype=torch.float32):
            return host_to_device(values, dtype, dev)

        greedy = [sp.greedy for sp in sps]
        any_top_k = any(sp.top_k > 0 for sp in sps)
        any_top_p = any(sp.top_p < 1.0 for sp in sps)
        any_min_p = any(sp.min_p > 0 for sp in sps)
        any_rep = any(sp.repetition_penalty != 1.0 for sp in sps)
        any_freq = any(sp.frequency_penalty != 0 for sp in sps)
        any_pres = any(sp.presence_penalty != 0 for sp in sps)
        edits = LogitsEdits()
        grammar_rows = []
        for i, r in enumerate(reqs):
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
                edits.banned.append((i, sorted(t for t in ids if t < self.vocab_size)))
            if sp.logit_bias:
                edits.bias.append((i, sp.logit_bias))
            if sp.allowed_token_ids:
                edits.allowed.append((i, sp.allowed_token_ids))
            if r.grammar is not None:
                grammar_rows.append(i)
        if grammar_rows:
            self._accept_uncollected()
            bitmask = fill_bitmask(
                [reqs[i].grammar for i in grammar_rows],  # type: ignore[misc]
                self.vocab_size,
                self.pin,
            )
            edits.bitmask = bitmask.to(dev, non_blocking=True)
            edits.bitmask_rows = col(grammar_rows, torch.int64)
        need_tokens = any_rep or any_freq or any_pres
        return SamplingBatch(
            temperature=col([1.0 if g else sp.temperature for g, sp in zip(greedy, sps)]),
            greedy=col(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=col([sp.top_k if sp.top_k > 0 else self.vocab_size for sp in sps], torch.int64)
            if any_top_k
            else None,
            top_p=col([sp.top_p for sp in sps]) if any_top_p else None,
            min_p=col([sp.min_p for sp in sps]) if any_min_p else None,
            presence=col([sp.presence_penalty for sp in sps]) if any_pres else None,
            frequency=col([sp.frequency_penalty for sp in sps]) if any_freq else None,
            repetition=col([sp.repetition_penalty for sp in sps]) if any_rep else None,
            output_tokens=[r.token_ids[r.num_prompt_tokens :] for r in reqs] if need_tokens else None,
            prompt_tokens=[r.token_ids[: r.num_prompt_tokens] for r in reqs] if need_tokens else None,
            edits=edits,
            generators=[r.generator for r in reqs],
            num_logprobs=[r.sampling_params.logprobs for r in reqs],
        )

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
                for rid in order:
                    self.requests[rid].num_computed_tokens += so.num_scheduled_tokens[rid]
                return StepHandle()
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch)
            logits = self.model.compute_logits(hidden[batch.logits_indices]).float()  # [S', V]
        h = StepHandle()
        if prompt_rows:
            # queued now, before the next launch can overwrite a CUDA graph's output buffer
            h.prompt_logprobs = self._prompt_logprobs(logits, prompt_rows)
        for rid in order:
            self.requests[rid].num_computed_tokens += so.num_scheduled_tokens[rid]
        if sampling:
            reqs = [self.requests[r] for r in sampling]
            rows = (
                logits
                if len(sample_rows) == logits.shape[0]
                else logits[self._to_device(np.asarray(sample_rows, dtype=np.int64))]
            )
            sb = self._sampling_batch(reqs)
            h.tokens = sample(rows, sb, self.generator)
            lt = logprob_tensors(rows, h.tokens, sb.num_logprobs)
            h.logprobs = lt.to_host() if lt is not None else None
            if self.device.type == "cuda":
                h.tokens_host = torch.empty(h.tokens.shape, dtype=h.tokens.dtype, pin_memory=True)
                h.tokens_host.copy_(h.tokens, non_blocking=True)
            h.states = reqs
            self._last_tokens = h.tokens
            self._last_rows = {r: i for i, r in enumerate(sampling)}
            self._uncollected = h
        if self.device.type == "cuda" and (h.tokens is not None or h.prompt_logprobs):
            # everything `collect` reads comes back through pinned memory behind an event
            # recorded now: it then waits for this step only, not for the next one launched
            # after it on the stream
            h.ready = torch.cuda.Event()
            h.ready.record()
        return h

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
    logprobs: LogprobTensors | None = None  # of the sampled rows that asked (host copies on CUDA)
    prompt_logprobs: dict[str, LogprobTensors] | None = None  # per request with prompt_logprobs
    grammar_accepted: bool = False  # its tokens are already in the matchers (read by the next launch)
