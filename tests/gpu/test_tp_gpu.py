"""Tensor parallelism over two GPUs (NCCL, one process per rank; skipped with fewer): float32
greedy token ids equal TP=1's with CUDA graphs on and off, and the engine shuts down promptly,
its worker process gone (an NCCL shutdown that waited for every rank once hung here)."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from tiny_models import save_tiny_model, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


def _run(path, tp, eager):
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16,
              max_num_batched_tokens=64, block_size=16, enforce_eager=eager, tensor_parallel_size=tp)
    try:
        outs = llm.generate(_prompts([1, 7, 30, 64, 100, 5], seed=1),
                            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        pids = list(getattr(llm.llm_engine.executor, "worker_pids", []))
    finally:
        start = time.monotonic()
        llm.llm_engine.executor.shutdown()
        took = time.monotonic() - start
    return [o.outputs[0].token_ids for o in outs], pids, took


@pytest.mark.parametrize("eager", [False, True])
def test_tp2_on_two_gpus_matches_tp1(tmp_path, tokenizer_dir, eager):
    path = save_tiny_model(tiny_config("llama", heads=4, kv_heads=2, hidden=128), str(tmp_path), tokenizer_dir, seed=3)
    ref, _, _ = _run(path, 1, eager)
    got, pids, took = _run(path, 2, eager)
    assert got == ref
    assert len(pids) == 1
    assert took < 15, f"shutdown took {took:.1f} s"
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
