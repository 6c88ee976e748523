"""SamplingParams.output_kind through the real engine: DELTA outputs add up to the CUMULATIVE
ones (tokens, text, logprobs; prompt logprobs once), FINAL_ONLY reports each request once with
the same final output, with n > 1 and a stop string among the requests."""

from __future__ import annotations

import pytest

from pagedllm import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=128)


@pytest.fixture(scope="module")
def engine(llm):
    return llm.llm_engine


def _params(kind: RequestOutputKind) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1, output_kind=kind),
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=9, ignore_eos=True, output_kind=kind),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["e"], output_kind=kind),
    ]


def _run(engine, kind: RequestOutputKind) -> dict[str, list]:
    prompts = ["The sky is blue because", "one two three", "hello there general"]
    for i, (p, sp) in enumerate(zip(prompts, _params(kind))):
        engine.add_request(str(i), p, sp)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_gpu_blocks
    return seen


def test_delta_and_final_only_agree_with_cumulative(engine):
    cum = _run(engine, RequestOutputKind.CUMULATIVE)
    delta = _run(engine, RequestOutputKind.DELTA)
    final = _run(engine, RequestOutputKind.FINAL_ONLY)
    assert sorted(cum) == sorted(delta) == sorted(final) == ["0", "1", "2"]
    for rid, outs in cum.items():
        last = outs[-1]
        assert last.finished and not any(o.finished for o in outs[:-1])
        # FINAL_ONLY: one output, the same as the cumulative one's end
        assert len(final[rid]) == 1 and final[rid][0].finished
        f = final[rid][0]
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in f.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in last.outputs]
        assert f.prompt_logprobs == last.prompt_logprobs
        # DELTA: the pieces add up, each piece is new, and the last one is marked finished
        d = delta[rid]
        assert d[-1].finished and not any(o.finished for o in d[:-1])
        for c in last.outputs:
            pieces = [x for o in d for x in o.outputs if x.index == c.index]
            assert "".join(x.text for x in pieces) == c.text
            assert [t for x in pieces for t in x.token_ids] == c.token_ids
            assert all(x.token_ids or x.finish_reason for x in pieces)
            assert [x.finish_reason for x in pieces][-1] == c.finish_reason
            if c.logprobs is not None:
                assert [lp for x in pieces for lp in x.logprobs] == c.logprobs
                assert pieces[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)
        plp = [o.prompt_logprobs for o in d if o.prompt_logprobs]
        if last.prompt_logprobs is not None:
            assert len(plp) == 1 and plp[0] == last.prompt_logprobs
    assert cum["1"][-1].outputs[0].token_ids != cum["1"][-1].outputs[1].token_ids  # n=2 really sampled twice
    assert cum["2"][-1].outputs[0].finish_reason == "stop" and cum["2"][-1].outputs[0].stop_reason == "e"


def test_generate_reports_final_outputs_only(llm):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["a b c", "d e f"], sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert sp.output_kind == RequestOutputKind.CUMULATIVE  # the caller's params are not changed


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


def test_final_only_text_leaves_out_the_stop_token(engine, llm):
    # FINAL_ONLY without stop strings decodes the text once at the end, from the request's ids:
    # a stop token ends the output but is not in its text (unless include_stop_str_in_output)
    tok = llm.get_tokenizer()
    probe = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, skip_special_tokens=False)
    engine.add_request("probe", "one two three", probe)
    ids = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
    stop_id = ids[4]
    for include in (False, True):
        texts = {}
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include, skip_special_tokens=False, output_kind=kind)
            seen = _run_one(engine, sp)
            c = seen[-1].outputs[0]
            assert c.finish_reason == "stop" and c.stop_reason == stop_id and c.token_ids[-1] == stop_id
            texts[kind] = c.text
        cut = ids[: ids.index(stop_id) + 1]
        expected = tok.decode(cut if include else cut[:-1], skip_special_tokens=False)
        assert texts[RequestOutputKind.FINAL_ONLY] == texts[RequestOutputKind.CUMULATIVE] == expected


def _run_one(engine, sp: SamplingParams) -> list:
    engine.add_request("one", "one two three", sp)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    return seen
