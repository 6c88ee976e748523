"""AsyncLLMEngine over a fake engine: streams, aborts, admission control, and the failure model
(a rejected request fails alone; a failing step fails the in-flight requests and the loop goes
on; an engine that cannot be cleaned up stops the loop, visibly)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fake_engine import FakeEngine
from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
)
from pagedllm.sampling_params import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def collect(engine, prompt, params, rid):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture()
def fake():
    return FakeEngine()


@pytest.fixture()
def engine(fake):
    eng = AsyncLLMEngine(fake, max_num_seqs=8)
    yield eng
    eng.shutdown()


def test_stream_is_cumulative_and_ends_finished(engine, fake):
    outs = run(collect(engine, [3, 4, 5], SamplingParams(max_tokens=5), "r1"))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert len(final.token_ids) == 5 and final.finish_reason == "length"
    assert final.text == fake.tokenizer.decode(final.token_ids)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths)
    assert engine.num_in_flight == 0


def test_many_concurrent_requests(engine):
    async def go():
        return await asyncio.gather(*(collect(engine, [i + 1], SamplingParams(max_tokens=3 + i % 4, n=1 + i % 2),
                                              f"r{i}") for i in range(20)))

    results = run(go())
    for i, outs in enumerate(results):
        assert len(outs[-1].outputs) == 1 + i % 2
        assert all(len(c.token_ids) == 3 + i % 4 for c in outs[-1].outputs)


def test_abort_ends_stream_with_abort_and_frees_engine(engine, fake):
    async def go():
        outs = []
        async for out in engine.generate([1], SamplingParams(max_tokens=100_000), "long"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("long")
        return outs

    outs = run(go())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert fake.aborted == ["long"] and not fake.requests


def test_closing_the_stream_aborts_the_request(engine, fake):
    async def go():
        stream = engine.generate([1], SamplingParams(max_tokens=100_000), "gone")
        async for _ in stream:
            break
        await stream.aclose()

    run(go())
    assert wait_until(lambda: fake.aborted == ["gone"])
    assert not fake.requests


def test_rejected_request_fails_alone(engine):
    async def go():
        bad = collect(engine, [], SamplingParams(max_tokens=2), "bad")
        good = collect(engine, [7], SamplingParams(max_tokens=2), "good")
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = run(go())
    assert isinstance(bad, ValueError) and "empty" in str(bad)
    assert good[-1].finished
    assert engine.is_running and not engine.errored


def test_failing_step_fails_in_flight_requests_and_loop_goes_on(engine, fake):
    failed = []

    def fail_once(eng):
        if not failed and len(eng.requests) == 3:
            failed.append(True)
            raise RuntimeError("boom")

    fake.step_hook = fail_once

    async def go():
        return await asyncio.gather(
            *(collect(engine, [i + 1], SamplingParams(max_tokens=50), f"r{i}") for i in range(3)),
            return_exceptions=True,
        )

    results = run(go())
    assert all(isinstance(r, RequestFailedError) and "boom" in str(r) for r in results)
    assert not fake.requests  # their engine state was cleaned up
    assert engine.is_running and not engine.errored
    outs = run(collect(engine, [1], SamplingParams(max_tokens=3), "after"))
    assert outs[-1].finished


def test_engine_that_cannot_recover_stops_the_loop_visibly(engine, fake):
    def fail(_):
        raise RuntimeError("step broke")

    def abort_fails(_):
        raise RuntimeError("abort broke too")

    fake.step_hook = fail
    fake.abort_request = abort_fails

    with pytest.raises(RequestFailedError):
        run(collect(engine, [1], SamplingParams(max_tokens=3), "r"))
    assert wait_until(lambda: engine.errored)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        run(collect(engine, [1], SamplingParams(max_tokens=3), "r2"))


def test_queue_limit(fake):
    engine = AsyncLLMEngine(fake, max_num_seqs=1, max_queue_len=1)
    try:
        async def go():
            a = engine.generate([1], SamplingParams(max_tokens=20), "a")
            b = engine.generate([2], SamplingParams(max_tokens=20), "b")
            with pytest.raises(QueueFullError):
                engine.generate([3], SamplingParams(max_tokens=20), "c")
            with pytest.raises(QueueFullError):
                engine.check_capacity(1)
            async for _ in a:
                pass
            async for _ in b:
                pass
            engine.check_capacity(2)  # room again

        run(go())
    finally:
        engine.shutdown()


def test_duplicate_request_id_is_refused(engine):
    async def go():
        stream = engine.generate([1], SamplingParams(max_tokens=100_000), "same")
        with pytest.raises(ValueError):
            engine.generate([1], SamplingParams(max_tokens=2), "same")
        await stream.aclose()

    run(go())


def test_shutdown_ends_open_streams(fake):
    engine = AsyncLLMEngine(fake)

    async def go():
        outs = []
        async for out in engine.generate([1], SamplingParams(max_tokens=100_000), "r"):
            outs.append(out)
            if len(outs) == 2:
                engine.shutdown(timeout=0)
        return outs

    outs = run(go())
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert wait_until(lambda: not engine.is_running)


def test_stat_loggers_see_stats_and_finished_requests(fake):
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedllm.engine.metrics import LoggingStatLogger, PrometheusStatLogger

    registry = CollectorRegistry()
    engine = AsyncLLMEngine(fake, stat_loggers=[PrometheusStatLogger("fake", registry, 128),
                                                LoggingStatLogger(interval=0.0)])
    try:
        run(collect(engine, [1], SamplingParams(max_tokens=4), "r"))
        assert wait_until(lambda: b"pagedllm:generation_tokens_total{model_name=\"fake\"} 4.0" in generate_latest(registry))
        text = generate_latest(registry).decode()
        assert 'pagedllm:request_success_total{finished_reason="length",model_name="fake"} 1.0' in text
        assert 'pagedllm:e2e_request_latency_seconds_count{model_name="fake"} 1.0' in text
        assert 'pagedllm:time_to_first_token_seconds_count{model_name="fake"} 1.0' in text
        assert 'pagedllm:request_generation_tokens_sum{model_name="fake"} 4.0' in text
    finally:
        engine.shutdown()


def test_final_only_yields_one_output_with_timings(fake):
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedllm.engine.metrics import PrometheusStatLogger

    registry = CollectorRegistry()
    engine = AsyncLLMEngine(fake, stat_loggers=[PrometheusStatLogger("fake", registry, 128)])
    try:
        async def go():
            return [o async for o in engine.generate([1], SamplingParams(max_tokens=6), "r", final_only=True)]

        outs = run(go())
        assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 6
        assert wait_until(lambda: b'pagedllm:time_per_output_token_seconds_count{model_name="fake"} 1.0'
                          in generate_latest(registry))
        text = generate_latest(registry).decode()
        assert 'pagedllm:time_to_first_token_seconds_count{model_name="fake"} 1.0' in text
        assert 'pagedllm:request_generation_tokens_sum{model_name="fake"} 6.0' in text
    finally:
        engine.shutdown()


def test_queue_limit_reads_max_num_seqs_from_the_engine():
    # without max_num_seqs, the limit is the engine's own scheduler_config.max_num_seqs (it
    # used to fall back to 256 whatever the engine said)
    engine = AsyncLLMEngine(FakeEngine(max_num_seqs=2, step_delay=0.05), max_queue_len=1)
    try:
        assert engine.max_num_seqs == 2

        async def go():
            streams = [engine.generate([i + 1], SamplingParams(max_tokens=50), f"r{i}") for i in range(3)]
            with pytest.raises(QueueFullError, match="max_num_seqs=2"):
                engine.generate([9], SamplingParams(max_tokens=50), "r3")
            engine.abort_all()
            for s in streams:
                async for _ in s:
                    pass

        run(go())
    finally:
        engine.shutdown()


def test_delta_stream_joins_what_a_slow_consumer_missed(engine, fake):
    # DELTA: a consumer that falls behind gets the deltas queued meanwhile as one output (the
    # pieces concatenated per sample), as a cumulative stream would give it the newest state
    from pagedllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=12, n=2, logprobs=1, output_kind=RequestOutputKind.DELTA)
    full = run(collect(engine, [5], SamplingParams(max_tokens=12, n=2, logprobs=1), "cum"))[-1]

    async def go():
        outs = []
        async for out in engine.generate([5], sp, "delta"):
            outs.append(out)
            await asyncio.sleep(0.02)  # several engine steps (1 ms each) go by
        return outs

    outs = run(go())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert len(outs) < 12  # joined: fewer outputs than tokens
    for c in full.outputs:
        pieces = [x for o in outs for x in o.outputs if x.index == c.index]
        assert [t for x in pieces for t in x.token_ids] == c.token_ids
        assert "".join(x.text for x in pieces) == c.text
        assert [lp for x in pieces for lp in x.logprobs] == c.logprobs
        assert [x.finish_reason for x in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert engine.num_in_flight == 0
