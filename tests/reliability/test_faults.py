"""Faults, through the test-only hook $PAGEDLLM_TEST_FAULT (see StepFault in engine/fault_injection.py):

- an engine step that raises fails the requests it was serving with an error response (a 500
  in OpenAI's shape, or an error event at the end of a stream that had begun), never a hang;
  the server goes on serving, correctly, with every block free;
- an engine loop that dies turns /health to 503, fails what was in flight, and the process
  exits with a non-zero status within 10 s.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import requests

from reliability_utils import (
    AUTH,
    SERVER_ARGS,
    ServerProcess,
    assert_healthy,
    finished_count,
    greedy_reference,
    stream_request,
    wait_idle,
)

pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time in a land far away"
BODY = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}


def _start(tiny_llama: str, tmp_path, fault: str) -> ServerProcess:
    server = ServerProcess(["--model", tiny_llama, *SERVER_ARGS], str(tmp_path / "server.log"),
                           env={"PAGEDLLM_TEST_FAULT": fault})
    return server.wait_ready()


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=30, trust_env=False)


def test_failed_step_fails_its_requests_and_the_server_goes_on(tiny_llama, tmp_path, offline_llm):
    # Step 1 (the first request's prefill) fails; so does step 6, a few tokens into the second
    # request's stream (its prefill is step 2).
    server = _start(tiny_llama, tmp_path, "step:1,step:6")
    try:
        # A non-streamed request whose first step fails: a 500 with OpenAI's error shape.
        r = requests.post(server.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert "injected fault" in err["message"]

        # A stream that has begun: its tokens so far, then an error event, then [DONE].
        async def streamed():
            async with _client(server.url) as client:
                return await asyncio.wait_for(stream_request(client, "/v1/completions", BODY), 30)

        s = asyncio.run(streamed())
        assert s.status == 200
        assert s.text(0), "the stream should have carried tokens before the fault"
        assert len(s.errors) == 1 and s.errors[0]["code"] == "engine_error", s.events[-2:]
        assert "error" in s.events[-1] and s.done

        # Faults are over: the server answers correctly, streamed and not, and holds no block.
        expected = greedy_reference(offline_llm, [PROMPT], BODY["max_tokens"])[0]
        r = requests.post(server.url + "/v1/completions", json=BODY, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected

        async def concurrent():
            async with _client(server.url) as client:
                return await asyncio.wait_for(
                    asyncio.gather(*(stream_request(client, "/v1/completions", BODY) for _ in range(4))), 60
                )

        assert [x.text(0) for x in asyncio.run(concurrent())] == [expected] * 4
        metrics = wait_idle(server)
        assert finished_count(metrics, "error") == 2
        assert_healthy(server)
    finally:
        rc = server.stop()
    assert rc == 0, server.log_tail()


def test_dead_engine_health_503_and_exit_nonzero(tiny_llama, tmp_path):
    server = _start(tiny_llama, tmp_path, "die:5")
    try:
        async def in_flight():
            async with _client(server.url) as client:
                plain = client.post("/v1/completions", json={**BODY, "max_tokens": 50}, headers=AUTH)
                streamed = stream_request(client, "/v1/completions", {**BODY, "max_tokens": 50})
                return await asyncio.wait_for(asyncio.gather(plain, streamed), 30)

        plain, streamed = asyncio.run(in_flight())
        died = time.monotonic()
        # Both requests in flight get an error, not a hang.
        assert plain.status_code == 503, plain.text
        assert plain.json()["error"]["code"] == "engine_unavailable"
        if streamed.status == 200:
            assert streamed.errors and streamed.errors[0]["code"] == "engine_unavailable" and streamed.done
        else:
            assert streamed.status == 503 and streamed.events[0]["error"]["code"] == "engine_unavailable"

        # /health says so while the server lingers, and new requests are turned away.
        r = requests.get(server.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        try:
            r = requests.post(server.url + "/v1/completions", json=BODY, headers=AUTH, timeout=5)
            assert r.status_code == 503 and r.headers.get("Retry-After")
        except requests.ConnectionError:
            pass  # already gone: that is what comes next anyway

        rc = server.proc.wait(10 - (time.monotonic() - died))
        assert rc != 0, server.log_tail()
        log = server.log_text()
        assert "the engine loop died" in log and "exiting with status" in log
    finally:
        server.stop()


@pytest.mark.parametrize("async_scheduling,grammar", [(False, False), (True, False), (True, True)],
                         ids=["sync", "async-scheduling", "async-scheduling-grammar"])
def test_failure_inside_a_step_frees_every_block(tiny_llama, offline_llm, async_scheduling, grammar, monkeypatch):
    """A fault deeper than the hook above: the executor fails while reading back a step that the
    scheduler has already planned (blocks allocated; with asynchronous scheduling the next step
    already launched; with a grammar on its own thread, that step's sampling still deferred).
    In-process, with the executor's `collect` patched on this one engine."""
    from pagedllm import SamplingParams
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine, RequestFailedError
    from pagedllm.structured_output import StructuredOutputsParams

    if grammar:
        monkeypatch.setenv("PAGEDLLM_GRAMMAR_THREAD", "1")

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=tiny_llama, max_model_len=256, kv_cache_memory="512KiB", async_scheduling=async_scheduling,
    ))
    executor = engine.engine.executor
    real_collect, calls = executor.collect, []

    def failing_collect(handle):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected: the device went away mid-step")
        return real_collect(handle)

    executor.collect = failing_collect
    so = StructuredOutputsParams(regex="[a-z ]{200,400}") if grammar else None
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, structured_outputs=so)
    prompts = [f"Request {i} is about to fail" for i in range(3)]

    async def run(tag: str) -> list:
        async def one(i: int):
            try:
                final = None
                async for out in engine.generate(prompts[i], params, f"{tag}-{i}"):
                    final = out
                return final.outputs[0].text
            except RequestFailedError as e:
                return e

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), 60)

    try:
        failed = asyncio.run(run("a"))
        assert all(isinstance(r, RequestFailedError) for r in failed), [type(r) for r in failed]
        if grammar:
            expected = [o.outputs[0].text for o in offline_llm.generate(prompts, params, use_tqdm=False)]
            assert all(re.fullmatch("[a-z ]+", t) for t in expected), expected
        else:
            expected = greedy_reference(offline_llm, prompts, 20)
        assert asyncio.run(run("b")) == expected  # the engine serves on, correctly
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = engine.last_stats
            if stats and stats.num_free_blocks == stats.num_gpu_blocks and stats.num_running == 0:
                break
            time.sleep(0.05)
        stats = engine.last_stats
        assert (stats.num_free_blocks, stats.num_running, stats.num_waiting) == (stats.num_gpu_blocks, 0, 0)
        assert not engine.errored
    finally:
        engine.shutdown()
