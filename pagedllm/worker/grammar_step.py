"""The model runner's structured-output state: the constrained requests' grammar matchers and
each step's grammar work (see worker/model_runner.py's docstring for where it sits in a step).

The matchers live in a `LocalGrammars` (in this process) or a `GrammarPool` (worker processes:
structured_output/pool.py), chosen at the first grammar. A step's work (`matcher.grammar_step`)
feeds the matchers the tokens of the launch not yet collected and fills the bitmask of this
step's constrained rows; on CUDA it runs on a thread of its own, joined before the sampler that
reads the mask.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.structured_output.matcher import GRAMMAR_TIMES, LocalGrammars, grammar_step

logger = logging.getLogger(__name__)

# While a grammar step runs on its thread, the interpreter hands the GIL over every 0.5 ms
# (Python's default is 5 ms): the engine thread and the grammar thread's Python parts then
# wait at most that long for each other.
GRAMMAR_SWITCH_INTERVAL = 0.0005


class GrammarSteps:
    def __init__(self, config: EngineConfig, vocab_size: int, device: torch.device, pin: bool):
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.pin = pin
        self.matchers: Any = None  # LocalGrammars or a GrammarPool, at the first grammar
        self._structured: Any = None  # StructuredOutputManager, only where grammars arrive uncompiled
        # a step's grammar work on a thread of its own (CUDA; PAGEDLLM_GRAMMAR_THREAD=1 / 0 forces it)
        env = os.environ.get("PAGEDLLM_GRAMMAR_THREAD")
        self.thread = device.type == "cuda" if env is None else env == "1"
        self._executor: ThreadPoolExecutor | None = None
        self._switch_interval: float | None = None  # the interpreter's, while a grammar step runs

    def new(self, so: Any, output_token_ids: list[int], eos_token_ids: frozenset[int]) -> Any:
        """A matcher for a request's structured output `so`, fed the request's output so far."""
        compiled = so.compiled
        if compiled is None:  # a worker in another process than the engine: compile here
            if self._structured is None:
                from pagedllm.model.loader import load_tokenizer
                from pagedllm.structured_output.manager import StructuredOutputManager

                mc = self.config.model_config
                tok = load_tokenizer(mc.model, mc.tokenizer, mc.gguf_file)
                self._structured = StructuredOutputManager(tok, self.vocab_size, eos_token_ids)
            compiled = self._structured.compile(so)
        if self.matchers is None:
            from pagedllm.structured_output.pool import GrammarPool, default_num_procs

            procs = default_num_procs(self.device.type)
            if procs:
                self.matchers = GrammarPool(
                    compiled.tokenizer_info.serialize_json(),
                    self.vocab_size,
                    self.config.scheduler_config.max_num_seqs,
                    procs,
                )
                logger.info("structured outputs: grammar matchers in %d worker processes", procs)
            else:
                self.matchers = LocalGrammars(self.vocab_size)
        return self.matchers.new(so, compiled, output_token_ids)

    def release(self, grammar: Any) -> None:
        self.matchers.release(grammar)

    def accept(self, grammars: list, tokens: list[int]) -> None:
        """Feeds a collected launch's tokens to its grammars (when no grammar step took them)."""
        self.matchers.accept(grammars, tokens)

    def start(self, prev: Any, grammars: list) -> Future | torch.Tensor:
        """A step's grammar work: the bitmask [G, W] of `grammars`, or, with the grammar
        thread, the future of it. The tokens of `prev` (the uncollected launch, a StepHandle or
        None) are accepted by this work, not by its `collect`."""
        ready, tokens, rows = None, None, []
        prev_grammars: list = []
        if prev is not None and prev.grammar_rows and not prev.grammar_accepted:
            assert prev.tokens is not None and prev.states is not None
            prev.grammar_accepted = True
            ready, rows = prev.ready, prev.grammar_rows
            tokens = prev.tokens_host if prev.tokens_host is not None else prev.tokens
            prev_grammars = [prev.states[i].grammar for i in rows]
        args = (self.matchers, ready, tokens, rows, prev_grammars, grammars, self.pin)
        if not self.thread:
            return grammar_step(*args)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        if self._switch_interval is None:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(GRAMMAR_SWITCH_INTERVAL)
        return self._executor.submit(grammar_step, *args)

    def join(self, job: Future) -> torch.Tensor:
        """The bitmask of a step started on the grammar thread (waits for it)."""
        t0 = time.perf_counter()
        bitmask = job.result()
        GRAMMAR_TIMES["join"] += time.perf_counter() - t0
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        return bitmask
