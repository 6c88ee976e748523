"""Helpers of the tensor-parallel tests: tiny checkpoints, prompts, and engines whose workers
are always shut down."""

from __future__ import annotations

import contextlib
import os
import random

from pagedllm import LLM, SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


def token_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def shutdown(llm: LLM) -> None:
    engine = llm.llm_engine
    stop = getattr(engine, "shutdown", None) or getattr(engine.executor, "shutdown", None)
    if stop is not None:
        stop()


@contextlib.contextmanager
def engine(path: str, **kwargs):
    llm = LLM(path, **kwargs)
    try:
        yield llm
    finally:
        shutdown(llm)


def process_gone(pid: int) -> bool:
    """True once pid has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:
        return not os.path.exists(f"/proc/{pid}")


@contextlib.contextmanager
def one_thread():
    """The TP=1 references run with one torch thread: on a 2-core machine two ranks take one
    core each, and one thread is also the fastest for these tiny models."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
