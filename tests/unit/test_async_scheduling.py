"""Asynchronous scheduling (step N+1 scheduled and launched before step N is read back) gives
the same tokens as synchronous stepping, stops where it should, and leaks no block."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler_output import ModelRunnerOutput
from sampling_reference import penalized_greedy_reference
from test_scheduler import assert_all_free, make_request, make_scheduler


def test_scheduler_runs_one_step_ahead():
    s = make_scheduler(budget=64)
    s.add_request(make_request("a", range(3, 13), max_tokens=3))
    s.add_request(make_request("b", range(20, 25), max_tokens=5))
    rng = random.Random(0)
    first = s.schedule()
    assert s.requests["a"].num_pending == 1
    while s.has_unfinished_requests():
        nxt = s.schedule()  # before `first` is read back
        s.check_invariants()
        for rid, n in nxt.num_scheduled_tokens.items():
            assert n == 1  # decodes of tokens still in flight
        ro = ModelRunnerOutput({rid: rng.randrange(3, 500) for rid in first.num_scheduled_tokens})
        s.update_from_output(first, ro)
        first = nxt
    s.update_from_output(first, ModelRunnerOutput({rid: 7 for rid in first.num_scheduled_tokens}))
    assert_all_free(s)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    kw = dict(kv_cache_memory="16MiB", max_model_len=256)
    return LLM(tiny_llama, async_scheduling=False, **kw), LLM(tiny_llama, async_scheduling=True, **kw)


def _gen(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_same_tokens_as_sync(engines):
    sync, asyn = engines
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True) for _ in prompts]
    assert _gen(sync, prompts, params) == _gen(asyn, prompts, params)
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=9, n=2) for i in range(4)]
    assert _gen(sync, prompts[:4], seeded) == _gen(asyn, prompts[:4], seeded)
    for llm in engines:
        st = llm.llm_engine.get_stats()
        assert st.num_free_blocks == st.num_gpu_blocks and llm.llm_engine._inflight is None


def test_stops_under_async(engines):
    sync, asyn = engines
    prompt = [[11, 22, 33, 44, 55]]
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = _gen(sync, prompt, base)[0][0]
    stop_tok = full[0][6]
    stop_str = full[1][4:7]
    for params in (base.clone(stop_token_ids=[stop_tok]), base.clone(stop=[stop_str]),
                   base.clone(stop=[stop_str], include_stop_str_in_output=True)):
        assert _gen(sync, prompt, params) == _gen(asyn, prompt, params)


def test_preemption_and_chunking_under_async(tiny_llama):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(5, 40))] for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # half with penalties: their device histories are rebuilt when a preempted request returns
    params = [greedy if i % 2 else greedy.clone(repetition_penalty=0.5, frequency_penalty=1.0) for i in range(8)]
    outs = {}
    for mode in ("recompute", "swap"):
        for asyn in (False, True):
            llm = LLM(tiny_llama, async_scheduling=asyn, block_size=4, max_model_len=64, kv_cache_memory=30 * 2 * 2 * 4 * 2 * 16 * 4,
                      preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=16)
            outs[(mode, asyn)] = _gen(llm, prompts, params)
            st = llm.llm_engine.get_stats()
            assert st.num_preemptions > 0 and st.num_free_blocks == st.num_gpu_blocks
    unpreempted = _gen(LLM(tiny_llama, block_size=4, max_model_len=64, kv_cache_memory="4MiB"), prompts, params)
    assert all(v == unpreempted for v in outs.values())


def test_abort_while_a_step_is_in_flight(engines):
    _, asyn = engines
    eng = asyn.llm_engine
    eng.add_request("x", list(range(100, 130)), SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request("y", list(range(200, 210)), SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng._inflight is not None
    eng.abort_request("x")
    seen = []
    while eng.has_unfinished_requests():
        seen += eng.step()
    assert [o.request_id for o in seen if o.finished] == ["y"]
    assert eng._inflight is None
    st = eng.get_stats()
    assert st.num_free_blocks == st.num_gpu_blocks


def test_a_row_given_up_while_its_step_is_in_flight(engines):
    """A request aborted while a step that samples for it is in flight: the next step gives its
    runner row to a new request before that sample is read back, which must not land in it."""
    sync, asyn = engines
    eng = asyn.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng.add_request("x", list(range(100, 130)), params)
    eng.step()
    eng.step()
    assert eng._inflight is not None
    eng.abort_request("x")
    eng.add_request("z", list(range(300, 310)), params)  # joins in the step that drops x
    seen = []
    while eng.has_unfinished_requests():
        seen += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in seen] == ["z"]
    assert seen[0].outputs[0].token_ids == _gen(sync, [list(range(300, 310))], params)[0][0][0]
    st = eng.get_stats()
    assert st.num_free_blocks == st.num_gpu_blocks


def test_penalties_and_min_tokens_run_ahead_and_match_a_reference(engines, tiny_llama):
    """Penalties and min_tokens read their histories on the device, so they no longer turn off
    asynchronous scheduling; the tokens equal a reference on transformers' logits, sync and async."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    base = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = [_gen(engines[0], [p], base)[0][0][0] for p in prompts]
    banned = sorted({plain[3][1], plain[3][3]})  # tokens greedy picks early, banned until 6 are out
    cases = [
        # (the random tiny model repeats nothing by itself: penalties below 1 / 0 make it repeat)
        dict(repetition_penalty=0.3),
        dict(frequency_penalty=0.5, presence_penalty=-2.0),
        dict(repetition_penalty=0.5, frequency_penalty=1.0),
        dict(min_tokens=6, stop_token_ids=banned),
    ]
    params = [base.clone(**kw) for kw in cases]
    expected = [
        penalized_greedy_reference(hf, p, 14, kw.get("repetition_penalty", 1.0), kw.get("frequency_penalty", 0.0),
                             kw.get("presence_penalty", 0.0), kw.get("min_tokens", 0), banned if "min_tokens" in kw else ())
        for p, kw in zip(prompts, cases)
    ]
    assert [e != p for e, p in zip(expected, plain)] == [True] * 4, "each case should change the greedy tokens"
    for llm in engines:
        eng = llm.llm_engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"pen-{i}", p, sp)
        assert eng._can_run_ahead() == eng.config.async_scheduling
        outs = {}
        ran_ahead = False
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            ran_ahead |= eng._inflight is not None
        assert ran_ahead == eng.config.async_scheduling
        assert [outs[f"pen-{i}"] for i in range(len(prompts))] == expected
        st = eng.get_stats()
        assert st.num_free_blocks == st.num_gpu_blocks
