"""The scheduler under pipeline parallelism, driven with several batches in flight (one per
stage, collected oldest first): a request is never in two in-flight batches, in-flight requests
are never preempted, every batch tells the workers the tokens they have not seen
(new_token_ids) so that a shadow of the workers' copies equals the scheduler's, and no block
leaks. Also the layer split of the stages and its override."""

from __future__ import annotations

import collections
import random

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.distributed.pipeline import default_layer_partition, resolve_layer_partition, stage_layers
from pagedllm.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, budget=24, max_seqs=8, mode="recompute", cpu_blocks=0) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=128,
                         preemption_mode=mode, scheduling_policy="fcfs", batch_wait_timeout=0.0)
    cc = CacheConfig(block_size=4, gpu_memory_utilization=0.9, kv_cache_memory=None, swap_space=1.0,
                     enable_prefix_caching=True)
    return Scheduler(sc, cc, num_blocks, cpu_blocks, pipeline_parallel=True)


def drive(s: Scheduler, depth: int, rng: random.Random, max_steps: int = 3000) -> dict[str, list[int]]:
    """Runs every request to the end with up to `depth` batches in flight; returns the workers'
    view of each request's tokens, rebuilt from the SchedulerOutputs alone."""
    shadow: dict[str, list[int]] = {}
    in_flight: collections.deque = collections.deque()
    seen_done: dict[str, list[int]] = {}
    steps = 0
    while s.has_unfinished_requests() or in_flight:
        while len(in_flight) < depth:
            so = s.schedule()
            s.check_invariants()
            if so.is_empty:
                break
            ids = set(so.num_scheduled_tokens)
            for _, other in in_flight:
                assert not ids & set(other.num_scheduled_tokens), "a request in two batches in flight"
            for gpu, _ in so.blocks_to_swap_out:
                assert gpu >= 0
            for new in so.scheduled_new_reqs:
                shadow[new.req_id] = list(new.token_ids)
            for c in so.scheduled_cached_reqs:
                shadow[c.req_id].extend(c.new_token_ids)
                # what the workers hold is what the scheduler knows: nothing missing, nothing extra
                assert shadow[c.req_id] == s.requests[c.req_id].all_token_ids
            sampling = [r for r in so.num_scheduled_tokens if s.requests[r].num_pending]
            in_flight.append((sampling, so))
        assert in_flight, "nothing scheduled and nothing in flight"
        sampling, so = in_flight.popleft()
        out = ModelRunnerOutput(sampled_token_ids={r: rng.randrange(3, 500) for r in sampling})
        for req, _ in s.update_from_output(so, out):
            if req.status.finished:
                seen_done[req.request_id] = list(req.all_token_ids)
        s.check_invariants()
        steps += 1
        assert steps < max_steps, "no progress"
    return seen_done


def add(s: Scheduler, rng: random.Random, n: int, max_tokens: int = 10) -> None:
    for i in range(n):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              max_tokens, frozenset({2})))


@pytest.mark.parametrize("depth", [2, 3])
def test_requests_are_in_one_batch_at_a_time(depth):
    rng = random.Random(depth)
    s = make_scheduler()
    add(s, rng, 12)
    done = drive(s, depth, rng)
    assert len(done) == 12 and all(len(t) > 10 for t in done.values())
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert not s.in_flight


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_spares_requests_in_flight(mode):
    """A pool too small for the load: preemptions happen, none of an in-flight request."""
    rng = random.Random(5)
    s = make_scheduler(num_blocks=14, mode=mode, cpu_blocks=64 if mode == "swap" else 0)
    add(s, rng, 10, max_tokens=16)
    preempted_in_flight = []
    original = s._preempt

    def watched(req, out):
        if req.request_id in s.in_flight:
            preempted_in_flight.append(req.request_id)
        original(req, out)

    s._preempt = watched
    done = drive(s, 2, rng)
    assert len(done) == 10 and s.num_preemptions > 0
    assert preempted_in_flight == []
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_layer_partition():
    assert default_layer_partition(32, 3) == (11, 11, 10)
    assert default_layer_partition(10, 4) == (2, 3, 3, 2)
    assert default_layer_partition(4, 2) == (2, 2)
    assert resolve_layer_partition(7, 1, {}) == ()
    assert resolve_layer_partition(8, 2, {"VLLM_PP_LAYER_PARTITION": "5,3"}) == (5, 3)
    # ours wins over vLLM's name
    assert resolve_layer_partition(8, 2, {"PAGEDLLM_PP_LAYER_PARTITION": "1,7", "VLLM_PP_LAYER_PARTITION": "5,3"}) == (1, 7)
    assert stage_layers((5, 3), 1, 8) == (5, 8) and stage_layers((), 0, 8) == (0, 8)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 .* num_hidden_layers=2"):
        resolve_layer_partition(2, 3, {})
    for bad, why in (("4,4,0", "3 entries"), ("6,3", "sums to 9"), ("x,3", "comma-separated"), ("8,0", "at least one")):
        with pytest.raises(ValueError, match=f"PAGEDLLM_PP_LAYER_PARTITION.*{why}"):
            resolve_layer_partition(8, 2, {"PAGEDLLM_PP_LAYER_PARTITION": bad})


def test_cli_flags():
    from pagedllm.entrypoints.cli import build_parser, engine_args_from_namespace

    ns = build_parser().parse_args(["serve", "m", "-pp", "2", "-dp", "3", "--data-parallel-prefix-affinity",
                                    "--distributed-executor-backend", "ray"])
    args = engine_args_from_namespace(ns)
    assert (args.pipeline_parallel_size, args.data_parallel_size, args.data_parallel_prefix_affinity) == (2, 3, True)
    ns = build_parser().parse_args(["serve", "m", "--pipeline-parallel-size", "4", "--data-parallel-size", "2"])
    args = engine_args_from_namespace(ns)
    assert (args.pipeline_parallel_size, args.data_parallel_size, args.data_parallel_prefix_affinity) == (4, 2, False)
