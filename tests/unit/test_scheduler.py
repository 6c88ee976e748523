"""Scheduler and block manager driven through schedule -> fake runner output -> update, with
the invariants checked after every step and every block free at the end."""

from __future__ import annotations

import random

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=128, mode="recompute",
                   policy="fcfs", prefix=True, cpu_blocks=64, wait_ms=0.0) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                         preemption_mode=mode, scheduling_policy=policy, batch_wait_timeout=wait_ms)
    cc = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, kv_cache_memory=None, swap_space=1.0,
                     enable_prefix_caching=prefix)
    return Scheduler(sc, cc, num_blocks, cpu_blocks if mode == "swap" else 0)


def make_request(rid, prompt, max_tokens=8, priority=0, arrival=None, **sp):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp)
    return Request(rid, list(prompt), params, max_tokens, frozenset({2}), arrival, priority)


def fake_output(s: Scheduler, out, rng: random.Random) -> ModelRunnerOutput:
    """What a runner returns: a token for each request whose chunk reached its end."""
    ro = ModelRunnerOutput()
    for rid in out.num_scheduled_tokens:
        if s.requests[rid].num_pending:
            ro.sampled_token_ids[rid] = rng.randrange(3, 500)
    return ro


def run_to_completion(s: Scheduler, rng: random.Random, max_steps=2000, on_step=None):
    steps = 0
    finished = []
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        s.check_invariants()
        for req, _ in s.update_from_output(out, fake_output(s, out, rng)):
            if req.status.finished:
                finished.append(req)
        s.check_invariants()
        if on_step:
            on_step(s, out)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return finished, steps


def assert_all_free(s: Scheduler):
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not bm.req_blocks and not bm.req_cpu_blocks
    assert len(bm.cpu_free) == bm.num_cpu_blocks
    assert all(b.ref_cnt == 0 for b in bm.blocks)


def test_continuous_batching_mixes_decodes_and_prefill_chunks():
    s = make_scheduler(budget=16)
    rng = random.Random(0)
    s.add_request(make_request("a", range(10, 50), max_tokens=6))
    s.add_request(make_request("b", range(100, 105), max_tokens=6))
    seen_mixed = []

    def on_step(sched, out):
        seen_mixed.append(len(out.num_scheduled_tokens))

    finished, _ = run_to_completion(s, rng, on_step=on_step)
    assert {r.request_id for r in finished} == {"a", "b"}
    assert all(r.num_output_tokens == 6 and r.status == RequestStatus.FINISHED_LENGTH for r in finished)
    assert max(seen_mixed) == 2
    assert_all_free(s)


def test_chunked_prefill_respects_budget():
    s = make_scheduler(budget=8, num_blocks=64)
    s.add_request(make_request("long", range(1, 38), max_tokens=3))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"long": 8}
    ro = ModelRunnerOutput()  # a partial chunk samples nothing
    s.update_from_output(out, ro)
    assert s.requests["long"].num_computed_tokens == 8
    finished, steps = run_to_completion(s, random.Random(1))
    assert finished[0].num_output_tokens == 3
    assert_all_free(s)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_blocks_run_out(mode):
    s = make_scheduler(num_blocks=12, block_size=4, budget=64, max_seqs=8, mode=mode)
    rng = random.Random(2)
    for i in range(6):
        s.add_request(make_request(f"r{i}", [rng.randrange(3, 500) for _ in range(6 + i)], max_tokens=12))
    finished, _ = run_to_completion(s, rng)
    assert len(finished) == 6
    assert all(r.num_output_tokens == 12 for r in finished)
    assert s.num_preemptions > 0
    if mode == "swap":
        assert s.num_swap_outs > 0
    assert_all_free(s)


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full():
    s = make_scheduler(num_blocks=12, block_size=4, budget=64, mode="swap", cpu_blocks=1)
    rng = random.Random(3)
    for i in range(5):
        s.add_request(make_request(f"r{i}", [rng.randrange(3, 500) for _ in range(8)], max_tokens=10))
    finished, _ = run_to_completion(s, rng)
    assert len(finished) == 5 and s.num_preemptions > 0
    assert_all_free(s)


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2, budget=100)
    for i in range(5):
        s.add_request(make_request(f"r{i}", [5, 6, 7], max_tokens=4))
    out = s.schedule()
    assert len(out.num_scheduled_tokens) == 2
    s.update_from_output(out, fake_output(s, out, random.Random(4)))
    run_to_completion(s, random.Random(4))
    assert_all_free(s)


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    s.add_request(make_request("a", range(3, 30), max_tokens=50))
    s.add_request(make_request("b", range(3, 9), max_tokens=50))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 5, "b": 6}))
    assert s.block_manager.num_free_blocks < s.block_manager.num_blocks
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    s.check_invariants()
    assert not s.has_unfinished_requests()
    assert s.block_manager.usage == 0.0
    assert s.schedule().finished_req_ids == {"a", "b"}


def test_prefix_cache_hit_shares_blocks_and_counts():
    s = make_scheduler(block_size=4)
    prompt = list(range(10, 30))  # 20 tokens = 5 full blocks
    s.add_request(make_request("a", prompt, max_tokens=2))
    run_to_completion(s, random.Random(5))
    s.add_request(make_request("b", prompt + [7, 8], max_tokens=2))
    out = s.schedule()
    assert s.requests["b"].num_cached_tokens == 20
    assert out.num_scheduled_tokens["b"] == 2 and s.requests["b"].num_computed_tokens == 22
    s.update_from_output(out, fake_output(s, out, random.Random(5)))
    bm = s.block_manager
    assert bm.prefix_cache_hits == 20 and bm.prefix_cache_queries == 20 + 22
    run_to_completion(s, random.Random(6))
    assert_all_free(s)


def test_full_prompt_hit_still_computes_last_token():
    s = make_scheduler(block_size=4)
    prompt = list(range(10, 26))  # exactly 4 blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(s, random.Random(7))
    s.add_request(make_request("b", prompt, max_tokens=1))
    out = s.schedule()
    assert s.requests["b"].num_cached_tokens == 12  # the last block is recomputed
    assert out.num_scheduled_tokens["b"] == 4


def test_same_step_sharing_between_new_requests():
    """Two requests with one prefix admitted in one step: the second hits blocks the first
    registers in the same step (their K/V are written before any attention reads them)."""
    s = make_scheduler(block_size=4, budget=100)
    prompt = list(range(40, 60))
    s.add_request(make_request("a", prompt + [1], max_tokens=2))
    s.add_request(make_request("b", prompt + [2], max_tokens=2))
    s.schedule()
    a, b = s.block_manager.get_block_ids("a"), s.block_manager.get_block_ids("b")
    assert a[:5] == b[:5] and a[5] != b[5]
    assert all(s.block_manager.blocks[x].ref_cnt == 2 for x in a[:5])


def test_lru_eviction_keeps_recent_prefixes():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    r1 = make_request("1", [1, 2, 3, 4])
    r2 = make_request("2", [5, 6, 7, 8])
    for r in (r1, r2):
        assert bm.allocate_slots(r, 4)
        bm.free(r)
    assert len(bm.hash_to_block) == 4
    r3 = make_request("3", [9, 10, 11, 12, 13])  # needs 3 blocks: evicts the oldest cached ones
    assert bm.allocate_slots(r3, 5)
    r4 = make_request("4", [5, 6, 7, 8, 99])
    hits = bm.get_computed_blocks(r4)
    r1b = make_request("1b", [1, 2, 3, 4, 99])
    assert bm.get_computed_blocks(r1b) == []  # r1 was least recently used
    assert len(hits) == 1  # r2's tail block was evicted before its head
    bm.check_invariants()


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    r = make_request("x", range(3, 20))
    assert not bm.allocate_slots(r, 17)
    assert bm.num_free_blocks == 3 and not bm.req_blocks
    bm.check_invariants()


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(policy="priority", max_seqs=1, budget=100)
    s.add_request(make_request("low", [5, 6], priority=5, arrival=1.0))
    s.add_request(make_request("high", [5, 7], priority=-1, arrival=2.0))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["high"]
    # each request fits the 16-token cache alone, not both together
    s2 = make_scheduler(policy="priority", num_blocks=4, block_size=4, budget=100, max_len=16)
    s2.add_request(make_request("a", range(3, 10), priority=0, arrival=1.0, max_tokens=8))
    s2.add_request(make_request("b", range(3, 10), priority=9, arrival=0.5, max_tokens=8))
    finished, _ = run_to_completion(s2, random.Random(8))
    assert s2.num_preemptions > 0 and finished[0].request_id == "a"
    assert_all_free(s2)


def test_batch_wait_timeout_holds_small_batches_briefly():
    s = make_scheduler(wait_ms=50.0, max_seqs=4)
    import time

    s.add_request(make_request("a", [5, 6, 7], arrival=time.monotonic()))
    assert s.schedule().is_empty
    assert 0 < s.batch_wait_remaining() <= 0.05
    time.sleep(0.06)
    assert not s.schedule().is_empty


def test_randomized_soak_keeps_invariants():
    rng = random.Random(9)
    for mode in ("recompute", "swap"):
        s = make_scheduler(num_blocks=20, block_size=4, budget=24, max_seqs=6, mode=mode, cpu_blocks=30)
        shared = [rng.randrange(3, 500) for _ in range(8)]
        for i in range(30):
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))]
            s.add_request(make_request(f"{mode}{i}", prompt, max_tokens=rng.randrange(1, 15)))

        def maybe_abort(sched, out):
            if rng.random() < 0.05 and sched.running:
                sched.finish_requests(rng.choice(sched.running).request_id, RequestStatus.FINISHED_ABORTED)

        run_to_completion(s, rng, on_step=maybe_abort)
        assert_all_free(s)
