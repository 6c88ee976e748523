"""Tensor parallelism (TP=2, gloo on the CPU) for the new architectures: Gemma 2 (soft caps,
sliding and global layers, (1 + w) norms) and Phi-3 (q/k/v and gate/up fused in the checkpoint,
each rank loading its heads' rows of them) give TP=1's greedy token ids and logprobs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedllm import SamplingParams
from tp_utils import engine, one_thread, prompts_of, token_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_archs_equivalence import _config, save_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=32, block_size=8)


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_tp2_matches_tp1(name, tmp_path, tokenizer_dir):
    path = save_model(_config(name), str(tmp_path), tokenizer_dir)
    prompts = prompts_of([1, 17, 40, 70], seed=1)
    lp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    with one_thread():
        with engine(path, **ENGINE) as llm:
            ref = token_ids(llm, prompts)
            ref_lp = llm.generate(prompts[3:], lp, use_tqdm=False)[0].outputs[0]
        with engine(path, tensor_parallel_size=2, **ENGINE) as llm:
            got = token_ids(llm, prompts)
            got_lp = llm.generate(prompts[3:], lp, use_tqdm=False)[0].outputs[0]
    assert got == ref
    assert got_lp.token_ids == ref_lp.token_ids
    for a, b in zip(ref_lp.logprobs, got_lp.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
