"""Data parallelism on the CPU: two engine replicas (a process each) behind one LLM and one
OpenAI server. Offline, DP=2 gives the token ids of one engine and uses both replicas; with
prefix affinity, prompts sharing a prefix go to one replica. The server answers 64 concurrent
requests (every one, with the offline text), /metrics shows both replicas at work, labelled
engine="0" / "1"; after a replica is killed, it reads as down while the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import requests

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from server_process import ServerProcess
from test_tp_server import children_of
from tp_utils import engine, one_thread, process_gone, prompts_of, token_ids

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64, block_size=8)


@pytest.fixture(scope="module")
def path(tmp_path_factory, tokenizer_dir) -> str:
    cfg = tiny_config("qwen3", layers=2, heads=4, kv_heads=2, head_dim=16)
    return save_tiny_model(cfg, str(tmp_path_factory.mktemp("dp")), tokenizer_dir, seed=3)


def test_dp2_matches_one_engine_and_uses_both_replicas(path):
    prompts = prompts_of([1, 5, 17, 33, 64, 2, 9, 40], seed=1)
    shared = prompts_of([40], seed=5)[0]
    family = [shared + p for p in prompts_of([1, 3, 7, 2, 5, 4], seed=6)]
    with one_thread():
        with engine(path, **ENGINE) as llm:
            ref = token_ids(llm, prompts)
        with engine(path, data_parallel_size=2, **ENGINE) as llm:
            client = llm.llm_engine
            assert type(client).__name__ == "DPEngineClient" and len(client.replicas) == 2
            assert token_ids(llm, prompts) == ref
            per = client.get_stats().replicas
            assert all(s.generation_tokens > 0 for s in per), per
            before = [s.generation_tokens for s in per]
            client.prefix_affinity = True  # what data_parallel_prefix_affinity=True sets
            token_ids(llm, family)
            after = [s.generation_tokens for s in client.get_stats().replicas]
            grew = [a > b for a, b in zip(after, before)]
            assert grew.count(True) == 1, (before, after)  # the whole family on one replica
            total = client.get_stats()
            assert total.num_free_blocks == total.num_gpu_blocks
            pids = [r.pid for r in client.replicas]
    deadline = time.monotonic() + 15
    while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(process_gone(p) for p in pids)


def metric(text: str, name: str, engine_index: int) -> float:
    """The value of `name` for replica `engine_index` in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'engine="{engine_index}"' in line and 'model_name="tiny"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} engine={engine_index} missing")


def test_server_dp2_serves_64_concurrent_requests_and_survives_a_dead_replica(path, tmp_path):
    import openai

    prompts = prompts_of([3, 8, 21, 30], seed=9)
    with one_thread(), engine(path, **ENGINE) as llm:
        ref = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                                                        use_tqdm=False)]
    server = ServerProcess(["--model", path, "-dp", "2", "--max-model-len", "256", "--kv-cache-memory", "8MiB",
                            "--block-size", "8", "--served-model-name", "tiny", "--disable-log-stats"],
                           str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        replicas = [p for p in children_of(server.proc.pid)
                    if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(replicas) == 2

        async def burst(n: int) -> list[str]:
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                outs = await asyncio.gather(*[
                    client.completions.create(model="tiny", prompt=prompts[i % 4], max_tokens=8, temperature=0.0)
                    for i in range(n)])
            return [o.choices[0].text for o in outs]

        texts = asyncio.run(burst(64))
        assert texts == [ref[i % 4] for i in range(64)]

        text = requests.get(server.url + "/metrics", timeout=10).text
        for i in (0, 1):
            assert metric(text, "pagedllm:dp_generation_tokens_total", i) > 0
            assert metric(text, "pagedllm:dp_replica_up", i) == 1
        assert sum(metric(text, "pagedllm:dp_generation_tokens_total", i) for i in (0, 1)) == 64 * 8

        async def streamed(n: int) -> list[str]:
            # DELTA outputs cross the replicas' pipes: the joined chunks are the same text
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                async def one(i: int) -> str:
                    stream = await client.completions.create(model="tiny", prompt=prompts[i % 4], max_tokens=8,
                                                             temperature=0.0, stream=True)
                    return "".join([c.choices[0].text async for c in stream])

                return await asyncio.gather(*[one(i) for i in range(n)])

        assert asyncio.run(streamed(8)) == [ref[i % 4] for i in range(8)]

        os.kill(replicas[1], signal.SIGKILL)
        time.sleep(0.5)
        assert asyncio.run(burst(8)) == [ref[i % 4] for i in range(8)]  # the other replica serves them all
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        deadline = time.monotonic() + 10
        while metric(requests.get(server.url + "/metrics", timeout=10).text, "pagedllm:dp_replica_up", 1) != 0:
            assert time.monotonic() < deadline, "replica 1 still reported up"
            time.sleep(0.2)
        assert "data-parallel replica 1" in server.log_text() and "SIGKILL" in server.log_text()
    finally:
        rc = server.stop()
    assert rc == 0, server.log_tail()
    deadline = time.monotonic() + 15
    while not all(process_gone(p) for p in replicas) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(process_gone(p) for p in replicas)
