"""SamplingParams validation and sampling behaviour through the real engine (tiny model)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=512, seed=0)


PROMPTS = [[101, 2002, 303, 44], [7, 8, 9, 10, 11, 12, 13], [4000]]


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1), ("logprobs", -2), ("prompt_logprobs", -2),
    ("seed", -2), ("stop", [""]), ("stop", 5), ("stop_token_ids", [-1]), ("ignore_eos", "yes"),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert tokens(greedy) == tokens(topk1)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    b = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], [sp, SamplingParams(temperature=1.0, max_tokens=5), sp], use_tqdm=False)
    assert tokens(a)[0] == tokens(b)[0] == tokens(b)[2]
    c = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert tokens(c)[0] != tokens(a)[0]


def test_random_sampling_varies_and_top_p_min_p_run(llm):
    sp = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = llm.generate([PROMPTS[0]] * 4, sp, use_tqdm=False)
    assert len({tuple(t) for t in tokens(outs)}) > 1
    # a top_p this small keeps only the most likely token: greedy
    narrow = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, narrow, use_tqdm=False)) == tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    # min_p = 1 keeps only tokens as likely as the top one: greedy too
    minp = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, minp, use_tqdm=False)) == tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, min_p=0.5, top_k=5, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(t) == 8 for t in tokens(outs))


def test_n_samples_share_prompt_blocks(llm):
    eng = llm.llm_engine
    before = eng.get_stats().prefix_cache_hits
    prompt = list(range(1000, 1040))
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs) == 3 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert eng.get_stats().prefix_cache_hits - before >= 2 * 32  # children 2 and 3 reuse the prompt's full blocks
    assert eng.get_stats().num_free_blocks == eng.get_stats().num_gpu_blocks


def test_penalties_change_repetition(llm):
    prompt = [500, 501, 502]
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = tokens(llm.generate([prompt], base, use_tqdm=False))[0]
    rep = tokens(llm.generate([prompt], base.clone(repetition_penalty=5.0), use_tqdm=False))[0]
    freq = tokens(llm.generate([prompt], base.clone(frequency_penalty=2.0, presence_penalty=2.0), use_tqdm=False))[0]
    assert len(set(rep)) >= len(set(plain))
    assert len(set(freq)) >= len(set(plain))
    assert rep != plain or len(set(plain)) == len(plain)


def test_stop_token_ids_and_min_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = tokens(llm.generate([PROMPTS[1]], base, use_tqdm=False))[0]
    stop_tok = plain[4]
    first = plain.index(stop_tok)
    out = llm.generate([PROMPTS[1]], base.clone(stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    out2 = llm.generate([PROMPTS[1]], base.clone(stop_token_ids=[stop_tok], min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert len(out2.token_ids) > first + 1 and stop_tok not in out2.token_ids[: first + 2]


def test_stop_strings_are_trimmed(llm):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], base, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 10
    stop = text[5:8]
    i = text.index(stop)
    out = llm.generate([PROMPTS[0]], base.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:i] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate([PROMPTS[0]], base.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: i + len(stop)]


def test_max_tokens_and_finish_length(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert all(len(c.token_ids) == 7 and c.finish_reason == "length" for o in outs for c in o.outputs)
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_default_max_tokens_is_16(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
