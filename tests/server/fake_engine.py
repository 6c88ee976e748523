"""A stand-in for LLMEngine with the same surface (add_request, abort_request, step, ...), for
testing the AsyncLLMEngine and the HTTP layer without a model: every step gives each request
one token, and the tokenizer maps a character to a token id and back. Outputs are cumulative,
or of the new token only for `output_kind` DELTA, or only the final one for FINAL_ONLY."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Callable

from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

VOCAB = 64


class FakeTokenizer:
    chat_template = "{{ messages }}"
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + (ord(c) % (VOCAB - 1)) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def apply_chat_template(self, conversation, chat_template=None, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    def __init__(self, max_model_len: int = 128, step_delay: float = 0.001, max_num_seqs: int = 256) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(served_model_name="fake", max_model_len=max_model_len,
                                            vocab_size=VOCAB, model="/models/fake")
        self.config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                                      parallel_config=SimpleNamespace(data_parallel_size=1))
        self.step_delay = step_delay
        self.requests: dict[str, tuple[list[int], SamplingParams, list[list[int]]]] = {}
        self.final_only: set[str] = set()
        self.metrics: dict[str, RequestMetrics] = {}
        self.aborted: list[str] = []
        self.step_hook: Callable[["FakeEngine"], None] | None = None
        self.generation_tokens = 0
        self.num_steps_scheduled = 0  # LLMEngine's step log (the fake schedules no steps)
        self.step_log: list = []

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) > self.model_config.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.requests[request_id] = (ids, params, [[] for _ in range(params.n)])
        self.metrics[request_id] = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            self.final_only.add(request_id)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.step_hook is not None:
            self.step_hook(self)
        time.sleep(self.step_delay)
        outputs = []
        for rid, (prompt, params, samples) in list(self.requests.items()):
            for i, toks in enumerate(samples):
                toks.append((prompt[-1] + len(toks) + i + 1) % VOCAB)
                self.generation_tokens += 1
            done = len(samples[0]) >= (params.max_tokens or 16)
            m = self.metrics[rid]
            m.last_token_time = time.monotonic()
            if m.first_token_time is None:
                m.first_token_time = m.first_scheduled_time = m.last_token_time
            if rid in self.final_only and not done:
                continue
            outs = []
            for i, toks in enumerate(samples):
                if params.output_kind == RequestOutputKind.DELTA:
                    toks = toks[-1:]  # only the new token
                lps = None
                if params.logprobs is not None:
                    lps = [{t: Logprob(-0.5, 1, self.tokenizer.decode([t])),
                            (t + 1) % VOCAB: Logprob(-1.5, 2, self.tokenizer.decode([(t + 1) % VOCAB]))}
                           for t in toks]
                outs.append(CompletionOutput(i, self.tokenizer.decode(toks), list(toks), None, lps,
                                             "length" if done else None))
            outputs.append(RequestOutput(rid, None, prompt, None, outs, done, metrics=m))
            if done:
                del self.requests[rid]
        return outputs

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=len(self.requests), num_waiting=0, num_swapped=0,
                               kv_cache_usage=len(self.requests) / 100, prefix_cache_queries=0,
                               prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0,
                               generation_tokens=self.generation_tokens)
