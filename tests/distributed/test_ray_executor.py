"""The Ray executor on a local Ray cluster (CPU, gloo): TP=2 as Ray actors gives the token ids
of TP=1; a dead actor is a RuntimeError naming its rank; shutdown removes the actors.
Skipped when ray is not installed (`pip install 'pagedllm[ray]'`)."""

from __future__ import annotations

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from tp_utils import engine, one_thread, prompts_of, token_ids

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _routed(monkeypatch):
    with one_thread():
        yield


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_ray_tp2_matches_tp1(local_ray, tmp_path, tokenizer_dir):
    path = save_tiny_model(tiny_config("qwen2", heads=4, kv_heads=2), str(tmp_path), tokenizer_dir, seed=5)
    prompts = prompts_of([1, 9, 33, 70], seed=6)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    kw = dict(kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=32, block_size=8)
    with engine(path, **kw) as llm:
        ref = token_ids(llm, prompts), token_ids(llm, prompts[:2], seeded)
    with engine(path, tensor_parallel_size=2, distributed_executor_backend="ray", **kw) as llm:
        ex = llm.llm_engine.executor
        assert type(ex).__name__ == "RayExecutor" and len(ex.worker_pids) == 2
        assert (token_ids(llm, prompts), token_ids(llm, prompts[:2], seeded)) == ref

        ray.kill(ex._actors[1], no_restart=True)
        with pytest.raises(RuntimeError, match="rank 1"):
            token_ids(llm, prompts[:1])
    assert ex._actors == []  # shutdown killed the actors and released the placement group
