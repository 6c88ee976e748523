"""The engine on CUDA (triton backend, CUDA graphs): float32 greedy equals transformers
float32 exactly; bf16 greedy checked the way vLLM checks it (where the two first differ, each
token is in the other's top-5 logprobs)."""

from __future__ import annotations

import random

import pytest
import torch

from tiny_models import save_tiny_model, tiny_config
from sampling_reference import penalized_greedy_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


def hf_generate(hf, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in out.scores]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("eager", [False, True])
def test_float32_greedy_equals_hf(tmp_path, tokenizer_dir, arch, eager):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    path = save_tiny_model(tiny_config(arch, heads=4, kv_heads=2, hidden=128, head_dim=32 if arch == "qwen3" else None),
                           str(tmp_path), tokenizer_dir, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16,
              max_num_batched_tokens=64, block_size=16, enforce_eager=eager)
    prompts = prompts_of([1, 7, 30, 64, 100, 130, 5, 17], seed=1)
    shared = prompts_of([40], seed=2)[0]
    prompts += [shared + [11], shared + [12, 13]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, _ = hf_generate(hf, p, 24)
        assert o.outputs[0].token_ids == ref
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("fused", ["1", "0"])
def test_float32_greedy_equals_hf_with_the_fused_argmax(tmp_path, tokenizer_dir, monkeypatch, fused):
    """All-greedy batches of one row and of ten (CUDA graphs) take their argmax through the fused
    sampler's kernels (the default) or, PAGEDLLM_GREEDY_TRITON=0, torch's: transformers' tokens either way."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.model import sampler

    monkeypatch.setenv("PAGEDLLM_GREEDY_TRITON", fused)
    sampler.greedy_triton.cache_clear()
    try:
        assert sampler.greedy_triton() == (fused == "1")
        path = save_tiny_model(tiny_config("llama", heads=4, kv_heads=2, hidden=128), str(tmp_path), tokenizer_dir, seed=3)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16)
        prompts = prompts_of([1, 7, 30, 64, 100, 130, 5, 17, 40, 3], seed=1)
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for batch in (prompts[:1], prompts):
            for p, o in zip(batch, llm.generate(batch, sp, use_tqdm=False), strict=True):
                assert o.outputs[0].token_ids == hf_generate(hf, p, 24)[0]
    finally:
        sampler.greedy_triton.cache_clear()


def _close_enough(ours, ours_lps, ref, ref_lps):
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert b in ours_lps[j], f"position {j}: HF token {b} not in our top-5"
            assert a in ref_lps[j].topk(5).indices.tolist(), f"position {j}: our token {a} not in HF top-5"
            return


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_greedy_close_to_hf(tmp_path, tokenizer_dir, arch):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    path = save_tiny_model(tiny_config(arch, heads=8, kv_heads=2, hidden=256, layers=3,
                                       head_dim=64 if arch == "qwen3" else None, initializer_range=0.05),
                           str(tmp_path), tokenizer_dir, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=8)
    prompts = prompts_of([9, 50, 120, 3], seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref, ref_lps = hf_generate(hf, p, 32)
        _close_enough(o.outputs[0].token_ids, o.outputs[0].logprobs, ref, ref_lps)


def test_long_context_runs(tmp_path, tokenizer_dir):
    from pagedllm import LLM, SamplingParams

    path = save_tiny_model(tiny_config("llama", hidden=128, max_pos=40000), str(tmp_path), tokenizer_dir, seed=6)
    llm = LLM(path, dtype="bfloat16", max_model_len=36000, gpu_memory_utilization=0.3, max_num_batched_tokens=8192)
    prompt = prompts_of([32768], seed=7)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64


def test_float32_logprobs_equal_hf_log_softmax(tmp_path, tokenizer_dir):
    """Sampled-token and prompt logprobs with CUDA graphs and asynchronous scheduling (they are
    queued at launch and read back behind the step's event) against HF's float32 log-softmax."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    path = save_tiny_model(tiny_config("llama", heads=4, kv_heads=2, hidden=128), str(tmp_path), tokenizer_dir, seed=6)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=8)
    prompts = prompts_of([5, 40, 12], seed=7)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
        ref, ref_lps = hf_generate(hf, p, 16)
        assert o.outputs[0].token_ids == ref
        for j, (t, lps) in enumerate(zip(ref, o.outputs[0].logprobs)):
            assert abs(lps[t].logprob - float(ref_lps[j][t])) < 1e-4
            top = ref_lps[j].topk(3).indices.tolist()
            assert set(top) <= set(lps)
        with torch.no_grad():
            full = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0].float(), -1)
        assert o.prompt_logprobs[0] is None
        for j in range(1, len(p)):
            assert abs(o.prompt_logprobs[j][p[j]].logprob - float(full[j - 1, p[j]])) < 1e-4


def test_float32_penalties_and_min_tokens_with_graphs_and_async(tmp_path, tokenizer_dir):
    """Penalties (device histories) and min_tokens under CUDA graphs and asynchronous
    scheduling, which they no longer turn off: greedy tokens equal transformers' float32
    logits with the penalties applied from plain lists."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    path = save_tiny_model(tiny_config("llama", heads=4, kv_heads=2, hidden=128), str(tmp_path), tokenizer_dir, seed=8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=8)
    assert llm.llm_engine.config.async_scheduling

    prompts = prompts_of([6, 33, 14, 70], seed=9)
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = penalized_greedy_reference(hf, prompts[3], 20)
    banned = sorted({plain[1], plain[4]})
    cases = [dict(rep=0.3), dict(freq=0.5, pres=-2.0), dict(rep=0.5, freq=1.0), dict(min_tokens=8)]
    params = [base.clone(repetition_penalty=c.get("rep", 1.0), frequency_penalty=c.get("freq", 0.0),
                         presence_penalty=c.get("pres", 0.0), min_tokens=c.get("min_tokens", 0),
                         stop_token_ids=banned if "min_tokens" in c else None) for c in cases]
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    assert eng._can_run_ahead()
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    for i, (p, c) in enumerate(zip(prompts, cases)):
        ref = penalized_greedy_reference(hf, p, 20, banned=banned if "min_tokens" in c else (), **c)
        assert outs[str(i)] == ref, f"case {c}"


def test_float32_greedy_equals_hf_with_context_buckets(tmp_path, tokenizer_dir, monkeypatch):
    """Context buckets (PAGEDLLM_GRAPH_CONTEXT_BUCKETS, on by default) with max_model_len 4,096: small decode batches replay graphs
    captured for a 1,024-token bound (fewer decode splits) until a context passes it, then the
    max_model_len graph; the tokens equal transformers' float32 on both sides of the bound."""
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.worker import cuda_graph

    monkeypatch.delenv("PAGEDLLM_GRAPH_CONTEXT_BUCKETS", raising=False)
    cuda_graph.context_buckets.cache_clear()
    try:
        path = save_tiny_model(tiny_config("llama", heads=4, kv_heads=2, hidden=128, max_pos=4096), str(tmp_path),
                               tokenizer_dir, seed=3)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        llm = LLM(path, dtype="float32", max_model_len=4096, gpu_memory_utilization=0.3, max_num_seqs=4)
        graphs = llm.llm_engine.executor.worker.runner.graphs
        assert graphs.bounds[1] == [1024, 4096] and (1, 1024) in graphs.graphs
        replayed = []
        run = graphs.run
        monkeypatch.setattr(graphs, "run", lambda n, s: replayed.append(s) or run(n, s))
        prompts = prompts_of([1000, 20], seed=9)  # the first crosses 1,024 while it decodes
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for p, o in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
            assert o.outputs[0].token_ids == hf_generate(hf, p, 40)[0]
        assert min(replayed) <= 1024 < max(replayed)
    finally:
        cuda_graph.context_buckets.cache_clear()
