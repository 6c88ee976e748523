"""Structured outputs and the other logits edits, offline, on a tiny random Llama: only the
constraint (never the model) can make these outputs valid. Grammars hold through n > 1,
prefix-cache hits, preemption (recompute and swap) and asynchronous scheduling, and give the
same tokens with and without run-ahead; a grammar that does not compile fails alone."""

from __future__ import annotations

import json
import os
import random
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output.matcher import apply_token_bitmask, unpack_bitmask
from pagedllm.structured_output.params import StructuredOutputsParams as SO
from test_async_scheduling import _gen, engines  # noqa: F401 - the sync and async engines fixture

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["alpha", "beta", "gamma delta"]
EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
LARK = 'start: "say " WORD "!"\nWORD: /[a-z]{1,5}/'


def _so(kind: str) -> SO:
    return {
        "json": lambda: SO(json=SCHEMA, disable_any_whitespace=True),
        "regex": lambda: SO(regex=REGEX),
        "choice": lambda: SO(choice=CHOICES),
        "ebnf": lambda: SO(grammar=EBNF),
        "lark": lambda: SO(grammar=LARK),
        "json_object": lambda: SO(json_object=True, disable_any_whitespace=True),
    }[kind]()


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"]), "properties come in the schema's order"
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    if kind == "ebnf":
        return re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", text) is not None
    return re.fullmatch(r"say [a-z]{1,5}!", text) is not None


KINDS = ["json", "regex", "choice", "ebnf", "lark", "json_object"]


def _assert_free(llm):
    st = llm.llm_engine.get_stats()
    assert st.num_free_blocks == st.num_gpu_blocks and not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("path", ["c-kernel", "torch"])
def test_bitmask_unpacks_to_the_reference(path, monkeypatch):
    from pagedllm.kernels import cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "bitmask_fill_", lambda *a: False)
    else:
        assert cpu_kernels.available(), "no C compiler: the CPU kernels are not built"
    g = torch.Generator().manual_seed(0)
    for vocab in (31, 32, 100, 1000):
        w = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (3, w), generator=g, dtype=torch.int64).to(torch.int32)
        ref = torch.tensor([[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)])
        assert torch.equal(unpack_bitmask(bitmask, vocab), ref)
        logits = torch.randn(5, vocab, generator=g)
        rows = torch.tensor([4, 0, 2])
        out = apply_token_bitmask(logits, bitmask, rows)
        expect = logits.clone()
        for i, r in enumerate(rows.tolist()):
            expect[r][~ref[i]] = float("-inf")
        assert torch.equal(out, expect) and not torch.isinf(logits).any()  # the input is untouched


def test_every_kind_constrains_a_random_model(engines):
    sync, _ = engines
    prompts = [[5 + i, 77, 900 + i] for i in range(len(KINDS))]
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=_so(k)) for k in KINDS]
    for kind, (outs,) in zip(KINDS, _gen(sync, prompts, params)):
        _, text, finish = outs
        assert finish == "stop", (kind, text)
        assert _valid(kind, text), (kind, text)
    # unconstrained, the same model writes none of it
    free = _gen(sync, prompts[:1], SamplingParams(temperature=0, max_tokens=20))[0][0][1]
    assert not _valid("regex", free)
    _assert_free(sync)


def test_sampled_n_and_prefix_hits_and_async_match_sync(engines):
    sync, asyn = engines
    prompt = [list(range(300, 340))]  # 40 tokens: full blocks, so the second run hits the cache
    params = [SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=80, structured_outputs=_so("json"))]
    first = _gen(sync, prompt, params)
    again = _gen(sync, prompt, params)
    run_ahead = _gen(asyn, prompt, params)
    assert first == again == run_ahead
    for _, text, finish in first[0]:
        assert finish == "stop" and _valid("json", text)
    assert sync.llm_engine.get_stats().prefix_cache_hits > 0
    mixed = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=_so(k)) for k in ("regex", "choice")]
    mixed.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    prompts = [[9, 8, 7], [6, 5, 4], [3, 4, 5]]
    assert _gen(sync, prompts, mixed) == _gen(asyn, prompts, mixed)
    for llm in engines:
        _assert_free(llm)


def test_grammar_thread_gives_the_same_tokens(engines, tiny_llama, monkeypatch):
    """The grammar work on its own thread with the sampling deferred (CUDA's default; forced
    here) gives the tokens of the inline path, through n > 1, constrained and unconstrained rows
    in one batch, with and without run-ahead; every block comes back."""
    from pagedllm.structured_output.matcher import GRAMMAR_TIMES

    sync, _ = engines
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_THREAD", "1")
    threaded = [LLM(tiny_llama, async_scheduling=a, kv_cache_memory="16MiB", max_model_len=256) for a in (False, True)]
    assert all(t.llm_engine.executor.worker.runner.grammars.thread for t in threaded)
    assert not sync.llm_engine.executor.worker.runner.grammars.thread
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17]]
    params = [SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=60, structured_outputs=_so("json")),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=_so("regex")),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, logprobs=2, structured_outputs=_so("ebnf"))]
    steps = GRAMMAR_TIMES["steps"]
    want = _gen(sync, prompts, params)
    inline_steps = GRAMMAR_TIMES["steps"] - steps
    for t in threaded:
        assert _gen(t, prompts, params) == want
        _assert_free(t)
    assert GRAMMAR_TIMES["steps"] - steps > 2 * inline_steps - 4 > 0  # both threaded engines did grammar steps
    for kind, outs in zip(["json", "regex", None, "ebnf"], want):
        for _, text, finish in outs:
            assert kind is None or (finish == "stop" and _valid(kind, text)), (kind, text)


def test_grammar_pool_gives_the_same_tokens(engines, tiny_llama, monkeypatch):
    """The matchers in two worker processes (structured_output/pool.py; CUDA's default on hosts
    with 8+ cores, forced here), inline and on the grammar thread, with run-ahead: the tokens of
    the in-process matchers, through n > 1 and requests finishing while their last step is in
    flight; every block comes back, and the workers exit with their engine."""
    import gc

    from pagedllm.structured_output.pool import GrammarPool

    sync, _ = engines
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_PROCS", "2")
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17]]
    params = [SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=60, structured_outputs=_so("json")),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=_so("regex")),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, logprobs=2, structured_outputs=_so("ebnf"))]
    want = _gen(sync, prompts, params)
    procs = []
    for thread in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_GRAMMAR_THREAD", thread)
        llm = LLM(tiny_llama, async_scheduling=True, kv_cache_memory="16MiB", max_model_len=256)
        assert _gen(llm, prompts, params) == want
        runner = llm.llm_engine.executor.worker.runner
        pool = runner.grammars.matchers
        assert isinstance(pool, GrammarPool) and pool.num_procs == 2
        # the workers hold the matchers of the requests the runner still knows (the last ones to
        # finish stay until the next step tells it), and none once an unconstrained batch has run
        assert sum(pool._live) == sum(st.grammar is not None for st in runner.requests.values()) > 0
        llm.generate([[5, 6]], SamplingParams(max_tokens=3), use_tqdm=False)
        assert sum(pool._live) == 0
        _assert_free(llm)
        procs += pool._procs
        del llm, pool, runner
    gc.collect()
    for p in procs:
        assert p.wait(10) == 0


def test_grammar_pool_in_a_script_without_a_main_guard(tiny_llama, tmp_path):
    """A user's script that builds its LLM at top level (no `if __name__ == "__main__"`): the
    grammar workers must not run it again (multiprocessing's spawn would import it in each)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "print('top level', os.getpid(), flush=True)\n"
        "from pagedllm import LLM, SamplingParams\n"
        "from pagedllm.structured_output.params import StructuredOutputsParams as SO\n"
        f"llm = LLM({tiny_llama!r}, kv_cache_memory='16MiB', max_model_len=128)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20,\n"
        "                   structured_outputs=SO(regex='(yes|no)')), use_tqdm=False)\n"
        "print('text', repr(out[0].outputs[0].text), flush=True)\n"
    )
    env = dict(os.environ, PAGEDLLM_GRAMMAR_PROCS="2")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert sum(line.startswith("top level") for line in lines) == 1, res.stdout
    assert [line for line in lines if line.startswith("text")] in (["text 'yes'"], ["text 'no'"]), res.stdout


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.extended)])
def test_grammar_survives_preemption(tiny_llama, mode):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(5, 30))] for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=_so(KINDS[i % 3])) for i in range(6)]
    outs = {}
    for small in (False, True):
        kw = dict(kv_cache_memory=30 * 2 * 2 * 4 * 2 * 16 * 4, block_size=4, max_num_batched_tokens=16,
                  preemption_mode=mode, swap_space=0.01) if small else dict(kv_cache_memory="16MiB")
        llm = LLM(tiny_llama, async_scheduling=True, max_model_len=64, **kw)
        outs[small] = _gen(llm, prompts, params)
        if small:
            assert llm.llm_engine.get_stats().num_preemptions > 0
        _assert_free(llm)
    assert outs[False] == outs[True]
    for i, ((_, text, _),) in enumerate(outs[True]):
        assert _valid(KINDS[i % 3], text), text


@pytest.mark.parametrize("so,match", [
    (dict(json={"type": "bogus"}), "json grammar does not compile"),
    (dict(regex="(abc"), "regex grammar does not compile"),
    (dict(grammar="root ::= missing"), "grammar grammar does not compile"),
])
def test_bad_grammar_fails_alone(engines, so, match):
    sync, _ = engines
    with pytest.raises(ValueError, match="structured_outputs: the " + re.escape(match) + ": [A-Z]"):
        sync.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=3), SamplingParams(structured_outputs=SO(**so))],
                      use_tqdm=False)
    _assert_free(sync)
    assert _gen(sync, [[4, 5]], SamplingParams(temperature=0, max_tokens=5, structured_outputs=_so("choice")))[0][0][1] in CHOICES


def test_params_validation_and_the_compile_cache(engines):
    with pytest.raises(ValueError, match="exactly one of"):
        SO(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    mgr = engines[0].llm_engine.structured_output_manager
    mgr.compile(SO(json=dict(SCHEMA), disable_any_whitespace=True))
    compiled, hits = mgr.num_compiled, mgr.num_cache_hits
    for _ in range(3):
        mgr.compile(SO(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    assert (mgr.num_compiled, mgr.num_cache_hits) == (compiled, hits + 3)
    # the same schema with its keys in another order is another grammar (property order is kept)
    mgr.compile(SO(json=json.dumps(SCHEMA, sort_keys=True), disable_any_whitespace=True))
    assert mgr.num_compiled == compiled + 1


def test_logit_bias_allowed_tokens_and_bad_words(engines):
    sync, asyn = engines
    prompt = [[10, 20, 30, 40]]
    free = _gen(sync, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0][0][0]
    forced = _gen(sync, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={123: 100}))
    assert forced[0][0][0] == [123] * 6
    banned = _gen(asyn, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               logit_bias={str(free[0]): -100}))
    assert banned[0][0][0][0] != free[0]
    allowed = [101, 202, 303]
    out = _gen(asyn, prompt, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed))
    assert set(out[0][0][0]) <= set(allowed)
    tok = sync.get_tokenizer()
    word = tok.decode(free[:2])
    out = _gen(sync, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word]))
    assert out[0][0][0][:2] != free[:2]
    with pytest.raises(ValueError, match="logit_bias"):
        sync.generate(prompt, SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    assert SamplingParams(seed=-1).seed is None
    with pytest.raises(ValueError, match="max_logprobs"):
        sync.generate(prompt, SamplingParams(logprobs=21), use_tqdm=False)
    out = sync.generate([list(range(100, 140))], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=7),
                        use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(133, 140))
    for llm in engines:
        _assert_free(llm)


def test_an_eos_past_the_vocabulary_is_not_the_grammar_end(engines):
    """A config whose EOS id lies past the (cut) vocabulary: a finished grammar must still allow
    a token (the tokenizer's own stop token), not none at all."""
    from pagedllm.structured_output.manager import StructuredOutputManager
    from pagedllm.structured_output.matcher import RequestGrammar, fill_bitmask, new_matcher

    sync, _ = engines
    tok = sync.get_tokenizer()
    vocab = sync.llm_engine.config.model_config.vocab_size
    mgr = StructuredOutputManager(tok, vocab, frozenset([vocab + 5]), max_threads=1)
    g = RequestGrammar(new_matcher(mgr.compile(SO(choice=["yes"]))), [])
    assert g.matcher.accept_string("yes") and not g.terminated
    allowed = unpack_bitmask(fill_bitmask([g], vocab, pin=False), vocab)[0]
    assert allowed.sum() >= 1 and allowed[tok.eos_token_id], "the finished grammar allows no token"


def test_grammar_pool_reports_a_worker_that_died_before_starting(tiny_llama):
    """A worker that is gone before the first fill (killed, crashed at import) is an error that
    names it, raised at once (its end of the socket pair closes), not a hang; the pool's
    finalizer still reaps the other worker."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedllm.structured_output.pool import GrammarPool

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)).serialize_json()
    pool = GrammarPool(info, len(tok), max_rows=4, num_procs=2)
    procs = list(pool._procs)
    procs[1].kill()
    procs[1].wait()
    with pytest.raises(RuntimeError, match=r"grammar worker 1 failed to start \(exit code -9\)"):
        pool.fill([], pin=False)
    del pool
    import gc

    gc.collect()
    assert procs[0].wait(10) == 0
