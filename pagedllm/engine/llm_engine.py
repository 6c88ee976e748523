"""LLMEngine: the synchronous engine. It owns the tokenizer, the scheduler, the executor and
the output processor; `add_request` validates and queues, `step` runs one schedule -> forward
-> update cycle and returns the RequestOutputs due (of the kind each request's
`SamplingParams.output_kind` asks for; engine/output_processor.py).

A request with `n > 1` becomes n child sequences that share the prompt's KV blocks through the
prefix cache; its RequestOutput gathers them. Under pipeline parallelism `step` keeps one batch
per stage in flight (engine/pipelined.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pipelined import step_pipelined
from pagedllm.engine.step_stats import STEP_LOG_LEN, EngineStats, StepRecord, StepTiming
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.data_parallel import DPEngineClient

__all__ = ["EngineStats", "LLMEngine", "PromptType", "StepRecord", "StepTiming"]

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from pagedllm.executor import make_executor
        from pagedllm.model.loader import eos_token_ids, load_tokenizer

        t0 = time.time()
        self.config = config
        mc = config.model_config
        self.model_config = mc
        from pagedllm.engine.generation_defaults import generation_defaults

        # SamplingParams defaults from generation_config.json (generation_config="auto")
        self.default_sampling_params: dict = generation_defaults(mc)
        if not config.skip_tokenizer_init:
            logger.info("loading the tokenizer of %s ...", mc.tokenizer)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(mc.model, mc.tokenizer, mc.gguf_file)
        self.eos_token_ids = eos_token_ids(mc.model, mc.gguf_file, mc.hf_config, self.tokenizer)
        self.executor = make_executor(config)
        cc = config.cache_config
        capacity = self.executor.num_gpu_blocks * cc.block_size
        if capacity < mc.max_model_len:
            self.executor.shutdown()
            raise ValueError(
                f"max_model_len={mc.max_model_len} does not fit the KV cache ({capacity} tokens); "
                f"lower max_model_len or give the cache more memory (kv_cache_memory / gpu_memory_utilization)"
            )
        self.pipeline_depth = config.parallel_config.pipeline_parallel_size
        self.scheduler = Scheduler(
            config.scheduler_config,
            cc,
            self.executor.num_gpu_blocks,
            self.executor.num_cpu_blocks,
            pipeline_parallel=self.pipeline_depth > 1,
        )
        # pipeline parallelism: (SchedulerOutput, handle) of the batches in flight, oldest first
        self._pipeline: deque = deque()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._inflight: tuple[SchedulerOutput, Any] | None = None  # a launched, uncollected step
        self._structured = None  # StructuredOutputManager, made with the first grammar
        # host seconds per phase of step(), summed: where an engine bound by its host spends
        # them ("collect" is the wait for the device's results; near 0 means host-bound)
        self.step_timing = StepTiming()
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        self.num_steps_scheduled = 0
        sc = config.scheduler_config
        logger.info(
            "engine ready in %.1fs: device %s, attention backend %s, dtype %s; scheduler: max_num_seqs %d, "
            "max_num_batched_tokens %d, block_size %d, max_model_len %d",
            time.time() - t0,
            config.device,
            config.attention_backend or "default",
            mc.dtype,
            sc.max_num_seqs,
            sc.max_num_batched_tokens,
            cc.block_size,
            mc.max_model_len,
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's behaviour)."""
        return SamplingParams(**self.default_sampling_params)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine | DPEngineClient:
        """The engine for `args`; with data_parallel_size > 1 the front end of that many
        replicas (engine/data_parallel.py), which offers the same methods."""
        config = args.create_engine_config()
        if config.parallel_config.data_parallel_size > 1:
            from pagedllm.engine.data_parallel import DPEngineClient

            return DPEngineClient(config)
        return cls(config)

    # ---- requests in -----------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                # the ids win; a text given beside them is kept for the output
                text = prompt.get("prompt") if isinstance(prompt.get("prompt"), str) else None
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer (skip_tokenizer_init is set)")
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt: token id {t!r} is outside the vocabulary [0, {vocab})")
            return text, ids
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request. Raises ValueError (naming the field) for bad input, leaving the
        engine unchanged. `params.output_kind` says which outputs `step` reports for it.
        `arrival_time` is on `time.monotonic()`, the clock of all request timing (RequestMetrics)."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params, text, ids = self.check_request(prompt, params, priority)
        max_len = self.model_config.max_model_len
        max_out = max_len - len(ids) if params.max_tokens is None else params.max_tokens
        max_out = max(1, min(max_out, max_len - len(ids) + 1))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        children = []
        for i in range(n):
            cp = params if n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            cid = request_id if n == 1 else f"{i}_{request_id}"
            children.append(Request(cid, ids, cp, max_out, self.eos_token_ids, arrival, priority))
        self.output_processor.add(request_id, text, ids, params, children, arrival)
        for child in children:
            self.scheduler.add_request(child)

    def check_request(
        self, prompt: PromptType, params: SamplingParams | None, priority: int
    ) -> tuple[SamplingParams, str | None, list[int]]:
        """Everything add_request checks before it queues anything (the data-parallel front end
        runs it too, before it picks a replica); returns (params, text or None, token ids)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens :]
        self.check_sampling_params(params)
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={max_len}")
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (skip_tokenizer_init is set)")
        return params, text, ids

    @property
    def structured_output_manager(self):
        """The grammar compiler and its cache (made on first use: it reads the vocabulary)."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: grammars need a tokenizer (skip_tokenizer_init is set)")
            from pagedllm.structured_output.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._structured

    def check_sampling_params(self, params: SamplingParams) -> None:
        """The checks that need the model: token ids in the vocabulary, logprobs within
        max_logprobs; tokenizes bad_words and compiles the grammar (cached). Raises ValueError."""
        vocab = self.model_config.vocab_size
        cap = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v == -1:
                if cap != -1:
                    raise ValueError(f"{name}=-1 (the whole vocabulary) needs the server's --max-logprobs -1")
                setattr(params, name, vocab)
            elif v is not None and cap != -1 and v > cap:
                raise ValueError(f"{name} must be <= max_logprobs={cap}, got {v}")
            elif v is not None and v > vocab:
                setattr(params, name, vocab)
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            bad = next(t for t in params.logit_bias if t >= vocab)
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids and any(t >= vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be < vocab size {vocab}")
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError("bad_words: bad words need a tokenizer (skip_tokenizer_init is set)")
            seqs = []
            for w in params.bad_words:
                # the word as it appears at the start of the output and after a space
                for variant in (w, " " + w.lstrip()):
                    ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
                    if ids and ids not in seqs:
                        seqs.append(ids)
            params.bad_words_token_ids = seqs
        if params.structured_outputs is not None:
            self.structured_output_manager.compile(params.structured_outputs)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stops the requests and frees their KV blocks now; no further output is produced."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            child_ids = self.output_processor.remove(rid)
            if child_ids:
                self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    @property
    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    # ---- one step --------------------------------------------------------------------
    def _can_run_ahead(self) -> bool:
        return self.config.async_scheduling and self.scheduler.num_needing_history == 0

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run, read back, update. With asynchronous scheduling the
        next step is scheduled and launched before this one's tokens are read back, so the
        device does not wait for the host's bookkeeping:

            host:   schedule N+1 | launch N+1 | collect N | update, detokenize N | ...
            device: ......... step N ......... | ........ step N+1 ........ |
        """
        if self.pipeline_depth > 1:
            return step_pipelined(self)
        tm, clock = self.step_timing, time.perf_counter
        t0 = clock()
        if self._inflight is None:
            so = self.scheduler.schedule()
            if so.is_empty:
                if so.finished_req_ids:
                    self.executor.execute_model(so)  # let the workers drop finished state
                wait = self.scheduler.batch_wait_remaining()
                if wait > 0:
                    time.sleep(min(wait, 0.002))
                return []
            t1 = clock()
            self._inflight = (so, self._launch(so))
            t2 = clock()
            tm.schedule += t1 - t0
            tm.launch += t2 - t1
            t0 = t2
        so, handle = self._inflight
        self._inflight = None
        if self._can_run_ahead():
            nxt = self.scheduler.schedule()
            t1 = clock()
            tm.schedule += t1 - t0
            if not nxt.is_empty or nxt.finished_req_ids:
                self._inflight = (nxt, self._launch(nxt))
            t0 = clock()
            tm.launch += t0 - t1
        runner_out = self.executor.collect(handle)
        t1 = clock()
        outputs = self._process(so, runner_out)
        t2 = clock()
        tm.collect += t1 - t0
        tm.process += t2 - t1
        tm.steps += 1
        if self._inflight is not None and not self.output_processor.requests:
            # nothing left to report: drain the look-ahead step (its requests have finished)
            so, handle = self._inflight
            self._inflight = None
            self.scheduler.update_from_output(so, self.executor.collect(handle))
        return outputs

    def _launch(self, so: SchedulerOutput) -> Any:
        if not so.is_empty:
            self.num_steps_scheduled += 1
            self.step_log.append(
                StepRecord(
                    self.num_steps_scheduled,
                    time.time(),
                    so.num_prefill_tokens,
                    so.num_decodes,
                    so.total_num_scheduled_tokens,
                    len(so.num_scheduled_tokens),
                )
            )
        return self.executor.launch(so)

    def _process(self, so: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        results = self.scheduler.update_from_output(so, runner_out)
        return self.output_processor.process(results, runner_out, self._stop)

    def _stop(self, child_id: str) -> None:
        """A stop string ended a sample: the scheduler frees its blocks now."""
        self.scheduler.finish_requests(child_id, RequestStatus.FINISHED_STOPPED)

    @property
    def prompt_tokens_total(self) -> int:
        return self.output_processor.prompt_tokens_total

    @property
    def generation_tokens_total(self) -> int:
        return self.output_processor.generation_tokens_total

    @property
    def num_gpu_blocks(self) -> int:
        return self.scheduler.block_manager.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.scheduler.block_manager.num_cpu_blocks

    def check_health(self) -> None:
        """Raises RuntimeError once the executor can run no more steps (a worker died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the workers (other processes under tensor parallelism). Idempotent."""
        self.executor.shutdown()

    # ---- introspection ---------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.scheduler
        bm = s.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            num_gpu_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            **self._expert_load_stats(),
        )

    def _expert_load_stats(self) -> dict:
        load = self.executor.expert_load()
        if not load:
            return {}
        from pagedllm.model.layers.fused_moe import load_per_rank

        pc = self.config.parallel_config
        return {
            "expert_load": load,
            "expert_load_per_rank": load_per_rank(load, pc.tensor_parallel_size, pc.enable_expert_parallel),
        }

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("messages: chat templates need a tokenizer (skip_tokenizer_init is set)")
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            chat_template=chat_template,
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
