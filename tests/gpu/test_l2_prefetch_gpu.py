"""The L2 prefetch (CUDA, sm_90+; skipped elsewhere): the kernel takes aligned, unaligned and
tiny ranges, inside a CUDA graph too, and leaves every byte as it was; an engine whose decode
graphs prefetch weights during attention (worker/weight_prefetch.py) samples the tokens of one
that does not, in float32 and bfloat16, with an FP8 model too (its GEMVs read the prefetched
FP8 weights)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="needs CUDA on sm_90+ and triton")]


def test_prefetch_ranges_leave_the_bytes_and_run_in_a_graph():
    from pagedllm.kernels.l2_prefetch import l2_prefetch

    x = torch.randn(3 << 20, device="cuda")  # 12 MiB
    before = x.clone()
    l2_prefetch(x)
    l2_prefetch(x[1:], 4 << 20)  # unaligned start, partial range
    l2_prefetch(x[:3])  # 12 bytes: nothing to ask
    l2_prefetch(x.view(torch.uint8)[5:37])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            l2_prefetch(x)
            y = x * 2
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before) and torch.equal(y, before * 2)


def _generate(path, monkeypatch, mb, prompts, **kw):
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_L2_PREFETCH_MB", mb)
    llm = LLM(path, max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16, **kw)
    graphs = llm.llm_engine.executor.worker.runner.graphs
    assert (graphs.prefetcher is not None) == (mb != "0")
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # one request at a time (graphs of batch 1, which prefetch) and all at once (batch 8: none)
    one = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    return one, together


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "fp8")])
def test_engine_with_prefetch_samples_the_same_tokens(tmp_path, tokenizer_dir, monkeypatch, dtype, quantization):
    import random

    from conftest import save_tiny_model, tiny_config

    cfg = tiny_config("llama", heads=4, kv_heads=2, hidden=256, layers=3, initializer_range=0.05)
    path = save_tiny_model(cfg, str(tmp_path), tokenizer_dir, seed=5)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (1, 9, 40, 3, 77, 16, 5, 30)]
    kw = dict(dtype=dtype, quantization=quantization)
    off = _generate(path, monkeypatch, "0", prompts, **kw)
    on = _generate(path, monkeypatch, "0.1", prompts, **kw)  # 100 kB: o_proj whole, part of gate_up
    assert on == off
    assert off[0] == off[1]
