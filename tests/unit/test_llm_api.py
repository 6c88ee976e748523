"""The offline API and LLMEngine: input forms, order, metrics, errors that name the field,
a bad request failing alone, aborts freeing blocks."""

from __future__ import annotations

import time

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=128)


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    text = "The sky is blue because"
    ids = tok.encode(text)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    single = llm.generate(text, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_one_params_per_prompt_and_metrics(llm):
    t0 = time.monotonic()
    outs = llm.generate(["a b c", "d e f"], [GREEDY, GREEDY.clone(max_tokens=2)], use_tqdm=True)
    t1 = time.monotonic()
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 2]
    m = outs[0].metrics
    # every request time is on time.monotonic(), the one clock of request timing
    assert t0 <= m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time <= t1
    assert 0 <= m.time_in_queue <= m.first_token_time - m.arrival_time
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])


def test_too_long_prompt_fails_alone(llm):
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", list(range(5, 300))], GREEDY, use_tqdm=False)
    assert not eng.has_unfinished_requests()
    assert eng.get_stats().num_free_blocks == eng.get_stats().num_gpu_blocks
    assert len(llm.generate(["still works"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize("prompt,match", [("", "empty"), ([], "empty"), ([10**9], "vocabulary"), ([-1], "vocabulary"),
                                          (3.5, "prompt")])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.llm_engine.add_request("bad", prompt, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_step_abort_frees_blocks(llm):
    eng: LLMEngine = llm.llm_engine
    eng.add_request("x", list(range(100, 140)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("y", list(range(200, 210)), SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="already"):
        eng.add_request("x", [1, 2], GREEDY)
    seen = []
    for _ in range(3):
        seen += eng.step()
    assert eng.get_stats().kv_cache_usage > 0
    eng.abort_request("x")
    while eng.has_unfinished_requests():
        seen += eng.step()
    assert {o.request_id for o in seen} == {"x", "y"}
    assert not any(o.finished for o in seen if o.request_id == "x")
    assert eng.get_stats().kv_cache_usage == 0.0
    eng.scheduler.check_invariants()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert "<|im_start|>assistant" in tok.decode(out.prompt_token_ids)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "no role"}])


@pytest.mark.parametrize("kwargs,field", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size"), (dict(block_size=12), "block_size"),
    (dict(dtype="int3"), "dtype"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(preemption_mode="drop"), "preemption_mode"),
    (dict(scheduling_policy="lifo"), "scheduling_policy"), (dict(load_format="pickle"), "load_format"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory"), (dict(swap_space=-1), "swap_space"),
    (dict(batch_wait_timeout=-5), "batch_wait_timeout"), (dict(max_model_len=10**7), "max_model_len"),
    (dict(model="/nonexistent/model"), "model"),
])
def test_engine_args_validation(tiny_llama, kwargs, field):
    args = dict(model=tiny_llama)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        EngineArgs(**args).create_engine_config()


def test_unknown_kwarg_and_cache_too_small(tiny_llama):
    with pytest.raises(ValueError, match="unknown"):
        LLM(tiny_llama, not_a_flag=1)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, kv_cache_memory="64KiB", max_model_len=1024)


def test_dummy_weights_and_no_prefix_caching(tiny_llama):
    llm = LLM(tiny_llama, load_format="dummy", kv_cache_memory="4MiB", max_model_len=128, enable_prefix_caching=False)
    outs = llm.generate([[5, 6, 7]] * 2, GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert llm.llm_engine.get_stats().prefix_cache_hits == 0
