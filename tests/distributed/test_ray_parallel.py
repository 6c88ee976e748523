"""Pipeline and data parallelism on a local Ray cluster (CPU, gloo): PP=2 as two Ray actors
gives the token ids of one engine, and a dead stage actor is a RuntimeError naming its stage;
DP=2 as two replica actors gives the same token ids, uses both replicas, and after one actor is
killed the other serves alone. Skipped when ray is not installed."""

from __future__ import annotations

import signal
import time

import pytest

from tiny_models import save_tiny_model, tiny_config
from tp_utils import engine, one_thread, prompts_of, token_ids

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=32, block_size=8)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster, started the way the engine starts one (init_ray), with a SIGTERM
    handler of ours installed first, as the server does; yields whether that handler survived
    (None when Ray was already up)."""
    from pagedllm.executor.ray_executor import init_ray

    started = not ray.is_initialized()

    def ours(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, ours)
    try:
        init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
        kept = signal.getsignal(signal.SIGTERM) is ours if started else None
    finally:
        signal.signal(signal.SIGTERM, before)
    yield kept
    if started:
        ray.shutdown()


def test_starting_ray_keeps_the_callers_sigterm_handler(local_ray):
    """ray.init installs a SIGTERM handler calling sys.exit(15): in the server it replaced the
    one that drains the requests and exits 0 (a Ray server exited 15 on SIGTERM)."""
    if local_ray is None:
        pytest.skip("Ray was started before this module")
    assert local_ray


def llama_with_reference(tmp_path_factory, tokenizer_dir) -> tuple[str, list[list[int]], list[list[int]]]:
    """A tiny Llama checkpoint, prompts, and one engine's greedy token ids for them."""
    path = save_tiny_model(tiny_config("llama", layers=3, heads=4, kv_heads=2), str(tmp_path_factory.mktemp("m")),
                           tokenizer_dir, seed=5)
    prompts = prompts_of([1, 9, 33, 70, 4], seed=6)
    with one_thread(), engine(path, **ENGINE) as llm:
        ref = token_ids(llm, prompts)
    return path, prompts, ref


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return llama_with_reference(tmp_path_factory, tokenizer_dir)


def test_ray_pp2_matches_and_a_dead_stage_is_named(local_ray, model):
    path, prompts, ref = model
    with one_thread(), engine(path, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        ex = llm.llm_engine.executor
        assert type(ex).__name__ == "RayExecutor" and len(ex.worker_pids) == 2 and ex.output_rank == 1
        assert token_ids(llm, prompts) == ref
        ray.kill(ex._actors[1], no_restart=True)
        with pytest.raises(RuntimeError, match=r"rank 1 \(pipeline stage 1"):
            token_ids(llm, prompts[:1])
    assert ex._actors == []


def test_ray_dp2_matches_uses_both_and_survives_a_dead_replica(local_ray, model):
    path, prompts, ref = model
    with one_thread(), engine(path, data_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        client = llm.llm_engine
        assert type(client.transport).__name__ == "RayReplicas"
        assert token_ids(llm, prompts * 2) == ref * 2
        assert all(s.generation_tokens > 0 for s in client.get_stats().replicas)
        ray.kill(client.transport.actors[1], no_restart=True)
        deadline = time.monotonic() + 30
        while client.replicas[1].alive:  # noticed on its next exchange
            assert time.monotonic() < deadline
            client.step()
        client.check_health()  # one replica left: still healthy
        assert token_ids(llm, prompts) == ref
        assert client.get_stats().replicas[1] is None
