"""The FP8 KV cache on the CPU (emulated through torch's float8 dtypes): its layout and memory plan,
the V layouts' switches, preemption by swap and prefix caching over it, and K stored less its
calibrated per-channel offset (worker/kv_offset.py): the attention unchanged by any offset, the
calibration against transformers' keys, under tensor and pipeline parallelism. The tiny model and
prompts are test_fp8.py's."""

from __future__ import annotations

import pytest
import torch
from test_fp8 import GREEDY, PROMPTS, save_plain

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.attention import Attention


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer_dir) -> str:
    return save_plain(tmp_path_factory, tokenizer_dir)


def test_fp8_kv_cache_layout_and_plan(plain):
    plans = {}
    for dtype in ("auto", "fp8"):
        llm = LLM(plain, kv_cache_memory="4MiB", max_model_len=256, kv_cache_dtype=dtype)
        w = llm.llm_engine.executor.worker
        plans[dtype] = (w.kv_cache.dtype, w.num_gpu_blocks, w.precision["kv_cache"])
        # V blocks of an FP8 cache are stored [Hkv, D, bs] (keys fastest), viewed [N, bs, Hkv, D]
        layers = [m for m in w.model.modules() if isinstance(m, Attention)]
        for i, layer in enumerate(layers):
            n, bs, h, d = w.kv_cache[i, 1].shape
            assert layer.v_cache.data_ptr() == w.kv_cache[i, 1].data_ptr() and layer.v_cache.shape == (n, bs, h, d)
            key_major = (bs * h * d, 1, d * bs, bs)
            assert layer.v_cache.stride() == (key_major if dtype == "fp8" else (bs * h * d, h * d, d, 1))
            assert layer.k_cache.is_contiguous()
    assert plans["auto"][0] == torch.float32 and plans["fp8"][0] == torch.float8_e4m3fn
    assert plans["fp8"][1] == 4 * plans["auto"][1]  # 1 byte instead of 4: four times the tokens
    assert plans["fp8"][2] == "fp8_e4m3"


def test_any_k_offset_leaves_the_attention_unchanged(plain):
    """Keys stored less any per-channel offset (worker/kv_offset.py) attend as before: every score
    of a query moves by the same q . c. A float32 cache (no rounding to hide a wiring mistake),
    random offsets of every layer: the same greedy tokens and logprobs through prefill chunks and
    decodes, while the cache holds other keys."""
    prompts = [[(7 * i + j) % 3000 + 3 for j in range(18 + 11 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = LLM(plain, kv_cache_memory="4MiB", max_model_len=128, enable_prefix_caching=False,
              max_num_batched_tokens=32)
    w = llm.llm_engine.executor.worker
    layers = [m for m in w.model.modules() if isinstance(m, Attention)]
    runs, caches = [], []
    for offset in (False, True):
        if offset:
            g = torch.Generator().manual_seed(0)
            for layer in layers:
                layer.k_offset = torch.randn(layer.num_kv_heads, layer.head_dim, generator=g) * 5
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        caches.append(w.kv_cache[:, 0].clone())
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert not torch.allclose(caches[0], caches[1])
    for layer in layers:
        layer.k_offset = None


def test_fp8_kv_offset_switch(monkeypatch):
    """On unless PAGEDLLM_FP8_KV_OFFSET=0; anything but 0 or 1 a ValueError naming the variable."""
    from pagedllm.worker import kv_offset

    monkeypatch.delenv("PAGEDLLM_FP8_KV_OFFSET", raising=False)
    assert kv_offset.enabled()
    for value, on in (("0", False), ("1", True), (" ", True)):
        monkeypatch.setenv("PAGEDLLM_FP8_KV_OFFSET", value)
        assert kv_offset.enabled() is on
    monkeypatch.setenv("PAGEDLLM_FP8_KV_OFFSET", "yes")
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_KV_OFFSET"):
        kv_offset.enabled()


def test_fp8_kv_offsets_calibrated_at_startup(plain, monkeypatch):
    """PAGEDLLM_FP8_KV_OFFSET (on by default) with an FP8 cache: the startup sets each layer's offset to the mean
    post-rotary key of its calibration prefill, transformers' own keys for the same random tokens
    (the first layer's to float32 rounding; the later layers' within the FP8 cache's effect on the
    attention before them, which the calibration runs through); off, or with a 16-bit cache, none.
    Generation then runs over the offset cache."""
    from transformers import AutoModelForCausalLM

    from pagedllm.worker import kv_offset

    for env, dtype, calibrated in (("", "fp8", True), ("0", "fp8", False), ("1", "auto", False), ("1", "fp8", True)):
        monkeypatch.setenv("PAGEDLLM_FP8_KV_OFFSET", env)
        llm = LLM(plain, kv_cache_memory="4MiB", max_model_len=128, kv_cache_dtype=dtype)
        layers = [m for m in llm.llm_engine.executor.worker.model.modules() if isinstance(m, Attention)]
        assert all((layer.k_offset is not None) == calibrated for layer in layers)
        if calibrated:
            offsets = [layer.k_offset for layer in layers]
            out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
    # transformers' post-rotary keys of the same tokens (its apply_rotary_pos_emb, recorded)
    from transformers.models.llama import modeling_llama

    n = 128  # min(CALIBRATION_TOKENS, max_model_len)
    ids = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(kv_offset.CALIBRATION_SEED))
    keys = []
    real = modeling_llama.apply_rotary_pos_emb

    def recorded(q, k, *a, **kw):
        q, k = real(q, k, *a, **kw)
        keys.append(k[0].mean(dim=1))  # [Hkv, D]: the mean over the tokens
        return q, k

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", recorded)
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    assert hf.config.vocab_size == 49152
    with torch.no_grad():
        hf(ids[None])
    assert len(keys) == len(offsets)
    torch.testing.assert_close(offsets[0], keys[0], atol=1e-5, rtol=1e-5)
    for got, want in zip(offsets, keys):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
        assert float((got - want).abs().mean()) < 0.1 * float(want.abs().mean())  # (a wiring slip: ~1)


def test_fp8_kv_offsets_under_tensor_parallelism(plain, monkeypatch):
    """Both ranks run the calibration prefill (its all-reduces pair up: no rank waits alone), each
    for its own kv head: rank r's offsets are TP=1's of head r (the first layer's exactly, the later
    ones within the FP8 cache's effect on the layers before), and TP=2 gives TP=1's greedy tokens."""
    monkeypatch.setenv("PAGEDLLM_FP8_KV_OFFSET", "1")
    got, offsets = {}, {}
    for tp in (1, 2):
        llm = LLM(plain, kv_cache_memory="4MiB", max_model_len=128, kv_cache_dtype="fp8", tensor_parallel_size=tp)
        offsets[tp] = llm.llm_engine.executor.collective_rpc("k_offsets")
        got[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        llm.llm_engine.shutdown()
        del llm
    (one,) = offsets[1]
    assert len(offsets[2]) == 2 and all(len(rank) == len(one) for rank in offsets[2])
    for r, rank in enumerate(offsets[2]):
        torch.testing.assert_close(rank[0], one[0][r : r + 1], atol=1e-5, rtol=1e-5)
        for got_layer, want in zip(rank, one):
            torch.testing.assert_close(got_layer, want[r : r + 1], atol=0.05, rtol=0.05)
    assert got[2] == got[1]


def test_fp8_kv_offsets_not_under_pipeline_parallelism(plain, monkeypatch):
    """Under pipeline parallelism no stage calibrates (a stage alone has no real hidden states):
    K is stored as it is, and generation runs as without the switch."""
    got = {}
    for env in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_FP8_KV_OFFSET", env)
        llm = LLM(plain, kv_cache_memory="4MiB", max_model_len=128, kv_cache_dtype="fp8", pipeline_parallel_size=2)
        assert all(o is None for stage in llm.llm_engine.executor.collective_rpc("k_offsets") for o in stage)
        got[env] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        llm.llm_engine.shutdown()
        del llm
    assert got["1"] == got["0"]


def test_v_key_major_switch_keeps_16_bit_tokens(plain, monkeypatch):
    """PAGEDLLM_V_TRANSPOSED=1 stores a 16-bit cache's V blocks key-major too (to compare the
    layouts on a GPU): the same greedy tokens, through prefix hits and a preemption by swap."""
    prompts = [[(5 * i + j) % 3000 + 3 for j in range(20 + 7 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_V_TRANSPOSED", switch)
        llm = LLM(plain, dtype="bfloat16", block_size=4, max_model_len=128, max_num_seqs=5,
                  preemption_mode="swap", swap_space=0.01, kv_cache_memory=2 * 2 * 4 * 2 * 64 * 2 * 40)
        layer = next(m for m in llm.llm_engine.executor.worker.model.modules() if isinstance(m, Attention))
        assert (layer.v_cache.stride(-1) == 4) == (switch == "1")
        got[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        got[switch] += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params, use_tqdm=False)]
        assert llm.llm_engine.scheduler.num_swap_outs > 0 and llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert got["1"] == got["0"]


def test_fp8_v_layout_switch_keeps_tokens(plain, monkeypatch):
    """PAGEDLLM_V_TRANSPOSED=0 keeps an FP8 cache's V blocks head_dim-major (the layout before):
    the same greedy tokens as the key-major default."""
    prompts = [[(3 * i + j) % 3000 + 3 for j in range(30 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = {}
    for switch in ("", "0"):
        monkeypatch.setenv("PAGEDLLM_V_TRANSPOSED", switch)
        llm = LLM(plain, kv_cache_memory="4MiB", max_model_len=128, kv_cache_dtype="fp8")
        layer = next(m for m in llm.llm_engine.executor.worker.model.modules() if isinstance(m, Attention))
        assert layer.v_cache.is_contiguous() == (switch == "0")
        got[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got["0"] == got[""]


def test_fp8_kv_cache_swap_and_prefix_caching_keep_tokens(plain):
    """Preemption by swap copies FP8 blocks out and back unchanged, and prefix-cache hits read
    the FP8 blocks another request wrote: the tokens equal an uninterrupted run's."""
    prompts = [[(7 * i + j) % 3000 + 3 for j in range(20 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = LLM(plain, kv_cache_memory="16MiB", max_model_len=128, kv_cache_dtype="fp8")
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    per_block = 2 * 2 * 4 * 2 * 64  # layers x (K, V) x block_size x kv heads x head_dim, 1 byte each
    tight = LLM(plain, block_size=4, max_model_len=128, max_num_seqs=6, kv_cache_dtype="fp8",
                preemption_mode="swap", swap_space=0.01, kv_cache_memory=per_block * 40)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.num_swap_outs > 0
    assert got == expected
    again = [o.outputs[0].token_ids for o in base.generate(prompts[:2], params, use_tqdm=False)]
    assert base.llm_engine.get_stats().prefix_cache_hits > 0 and again == expected[:2]
