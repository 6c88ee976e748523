"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.engine.arg_utils import split_engine_kwargs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """model=None uses the embedded SmolLM2-135M-Instruct. Keyword arguments are EngineArgs
    fields (vLLM's names: dtype, max_model_len, block_size, kv_cache_memory, ...); a vLLM
    argument with no meaning here is accepted and logged, an unknown one is a ValueError."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        kwargs = split_engine_kwargs(EngineArgs, kwargs)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without SamplingParams: generation_config.json's defaults."""
        return self.llm_engine.get_default_sampling_params()  # type: ignore[misc]

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        if (
            isinstance(prompts, str)
            or isinstance(prompts, dict)
            or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.llm_engine.get_default_sampling_params()  # type: ignore[misc]
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts; give one or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        final: dict[int, SamplingParams] = {}  # one FINAL_ONLY copy of each params object given
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                if isinstance(sp, SamplingParams) and sp.output_kind != RequestOutputKind.FINAL_ONLY:
                    if id(sp) not in final:
                        final[id(sp)] = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                    sp = final[id(sp)]
                try:
                    engine.add_request(rid, p, sp, priority=0 if priority is None else priority[i])
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        t0 = time.perf_counter()
        out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.error is not None:  # e.g. a data-parallel replica died under it
                        raise RuntimeError(f"request {out.request_id}: {out.error}")
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - t0):.1f} tok/s")
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        convs: list = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
            engine: Any = self.llm_engine  # an LLMEngine, or the DP front end (the same method)
            prompts.append(engine.apply_chat_template(conv, add_generation_prompt, chat_template))
        return self.generate(prompts, sampling_params, use_tqdm)
