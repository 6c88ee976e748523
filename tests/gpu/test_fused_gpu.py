"""The fused decode-step kernels against their torch references (CUDA; skipped without it):

- q/k RMSNorm + rotary + store-KV from the qkv projection's output (kernels/qkv_rope_triton.py),
  with and without the norm (Qwen3 / Llama), on 16-bit and FP8 caches with scales, padding
  slots (-1) left alone; and against the unfused Triton kernels it replaces;
- the engine with the option on (PAGEDLLM_FUSED_ROPE_KV): greedy tokens of tiny float32 models
  equal the unfused path's and transformers'.

The `check_*` functions take a device, so tests/unit/test_fused_interpret.py runs them on the
CPU under Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels import ELEMENTWISE_TOL, _close, _randn, _rope_cache  # noqa: E402

from pagedllm.attention.backend import key_major_view, v_cache_view  # noqa: E402
from pagedllm.kernels.qkv_rope import qkv_norm_rope_store_torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _qkv_inputs(device, dtype, num_tokens, hq, hkv, head_dim, block_size, cache, seed, v_key_major=False):
    g = torch.Generator().manual_seed(seed)
    max_pos = 4096
    cos, sin = (c.to(device) for c in _rope_cache(max_pos, head_dim))
    pos = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    qkv = _randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, device=device, gen=g)
    num_blocks = math.ceil(num_tokens / block_size) * 2 + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding tokens are not stored
    cache_dtype = _CACHE_DTYPES[cache] or dtype
    kc = _randn(num_blocks, block_size, hkv, head_dim, dtype=torch.float32, device=device, gen=g).to(cache_dtype)
    vc = _randn(num_blocks, block_size, hkv, head_dim, dtype=torch.float32, device=device, gen=g).to(cache_dtype)
    # the engine's layout (FP8: blocks stored key-major), or key-major whatever the dtype
    vc = (key_major_view if v_key_major else v_cache_view)(torch.empty_like(vc)).copy_(vc)
    qw = _randn(head_dim, dtype=dtype, device=device, gen=g) * 0.1 + 1
    kw = _randn(head_dim, dtype=dtype, device=device, gen=g) * 0.1 + 1
    return qkv, pos, cos, sin, kc, vc, slots.to(device), qw, kw


# After a q/k norm whose sum of squares is added in another order, a normed value may round one
# ulp the other way; the rotation then moves that ulp (of values up to ~4) into outputs near
# zero, where no relative tolerance helps: an absolute one of that ulp.
NORM_ROPE_TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2**-8, 2e-3), torch.bfloat16: (2**-5, 1.6e-2)}


# A layer's outputs, fused vs not: the few one-ulp differences above, carried through the
# layer's products (a wiring mistake is off by O(1))
LAYER_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 4e-2)}


def _cache_close(actual, expected, scale, what, act_dtype, tol=ELEMENTWISE_TOL, offset=None):
    """16-bit caches: within the elementwise tolerance. FP8 caches: the 16-bit values before
    the cast differ within that tolerance, which may move a stored value one FP8 step (2^-3
    relative for e4m3, 2^-2 for e5m2, plus the subnormal step) or, near zero, a little more:
    dequantized values within one step plus the 16-bit tolerance, and most bytes equal. Keys
    stored less an offset: the 16-bit tolerance is that of the key itself (stored value + offset),
    which may be far from the small difference stored."""
    if actual.dtype.itemsize == 1:
        a, e = actual.float() * scale, expected.float() * scale
        rel = 2**-3 if actual.dtype == torch.float8_e4m3fn else 2**-2
        atol, rtol = tol[act_dtype]
        k = e if offset is None else e + offset.float()
        bound = e.abs() * rel + k.abs() * rtol + scale * 2**-9 + atol
        assert bool(((a - e).abs() <= bound).all()), f"{what}: more than one FP8 step off"
        same = (actual.view(torch.uint8) == expected.view(torch.uint8)).float().mean().item()
        assert same >= 0.9, f"{what}: only {same:.3f} of the FP8 bytes equal the reference's"
    else:
        _close(actual, expected, tol, what)


def check_qkv_rope_store(device, dtype, num_tokens, hq, hkv, head_dim, block_size, qk_norm=False,
                         cache="auto", k_scale=1.0, v_scale=1.0, block_h=None, seed=0, v_key_major=False,
                         k_offset=False):  # fmt: skip
    """v_key_major: V blocks stored [Hkv, D, bs], and a NaN and an infinity in the first stored
    token's V (stored as 0 and saturated, as store_kv_torch does). k_offset: K stored less a
    random per-channel offset (worker/kv_offset.py) by both."""
    from pagedllm.kernels.qkv_rope_triton import qkv_norm_rope_store_triton

    qkv, pos, cos, sin, kc, vc, slots, qw, kw = _qkv_inputs(device, dtype, num_tokens, hq, hkv, head_dim,
                                                            block_size, cache, seed, v_key_major)  # fmt: skip
    if v_key_major:
        first = int(torch.nonzero(slots >= 0)[0])
        qkv[first, (hq + hkv) * head_dim:][:2] = torch.tensor([float("nan"), float("inf")], dtype=dtype)
    norms = (qw, kw) if qk_norm else (None, None)
    before = qkv.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    offset = None
    if k_offset:
        offset = torch.randn(hkv, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(device) * 2
    q = qkv_norm_rope_store_triton(qkv, pos, cos, sin, kc, vc, slots, hq, hkv, head_dim, *norms, 1e-6,
                                   k_scale, v_scale, block_h=block_h, k_offset=offset)  # fmt: skip
    q_ref = qkv_norm_rope_store_torch(qkv, pos, cos, sin, kc_ref, vc_ref, slots, hq, hkv, head_dim, *norms,
                                      1e-6, k_scale, v_scale, offset)  # fmt: skip
    if offset is not None:  # the offset is taken: the stored keys are not those without it
        kc_plain, vc_plain = kc.clone().zero_(), vc.clone()
        qkv_norm_rope_store_torch(qkv, pos, cos, sin, kc_plain, vc_plain, slots, hq, hkv, head_dim, *norms,
                                  1e-6, k_scale, v_scale)  # fmt: skip
        stored = slots[slots >= 0]
        flat_plain = kc_plain.view(-1, hkv, head_dim)[stored].float() * k_scale
        flat_kc = kc.view(-1, hkv, head_dim)[stored].float() * k_scale
        assert float((flat_plain - offset - flat_kc).abs().mean()) < float((flat_plain - flat_kc).abs().mean()) / 4
    assert q.shape == (num_tokens, hq, head_dim) and q.is_contiguous()
    tol = NORM_ROPE_TOL if qk_norm else ELEMENTWISE_TOL
    _close(q, q_ref, tol, "q")
    _cache_close(kc, kc_ref, k_scale, "k cache", dtype, tol, offset)
    _cache_close(vc, vc_ref, v_scale, "v cache", dtype)
    assert torch.equal(qkv.view(torch.uint8), before.view(torch.uint8)), "qkv must not be written"
    # the slots of padding tokens and every other slot keep what they held
    written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    flat = kc.view(-1, hkv, head_dim).view(torch.uint8) if kc.dtype.itemsize == 1 else kc.view(-1, hkv, head_dim)
    flat_ref = kc_ref.view(-1, hkv, head_dim)
    flat_ref = flat_ref.view(torch.uint8) if flat_ref.dtype.itemsize == 1 else flat_ref
    assert torch.equal(flat[~written], flat_ref[~written]), "a slot nobody writes was changed"


def check_qkv_rope_store_equals_unfused_triton(device, dtype, num_tokens, hq, hkv, head_dim, block_size,
                                               qk_norm=False, cache="auto", k_scale=1.0, v_scale=1.0, seed=0):
    """The fused kernel against the chain of Triton kernels the layer runs without it: bit-equal
    without the norm, within the elementwise tolerance with it."""
    from pagedllm.kernels.attention import store_kv_triton
    from pagedllm.kernels.norm_triton import rms_norm_triton
    from pagedllm.kernels.qkv_rope_triton import qkv_norm_rope_store_triton
    from pagedllm.kernels.rotary_triton import apply_rotary_triton

    qkv, pos, cos, sin, kc, vc, slots, qw, kw = _qkv_inputs(device, dtype, num_tokens, hq, hkv, head_dim,
                                                            block_size, cache, seed)  # fmt: skip
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = qkv_norm_rope_store_triton(qkv, pos, cos, sin, kc, vc, slots, hq, hkv, head_dim,
                                   *((qw, kw) if qk_norm else (None, None)), 1e-6, k_scale, v_scale)  # fmt: skip
    qs, ks = hq * head_dim, hkv * head_dim
    q0, k0, v0 = qkv.split([qs, ks, ks], dim=-1)
    q0, k0, v0 = (t.reshape(num_tokens, -1, head_dim) for t in (q0, k0, v0))
    if qk_norm:
        q0, k0 = rms_norm_triton(q0, qw, 1e-6), rms_norm_triton(k0, kw, 1e-6)
    q0, k0 = apply_rotary_triton(pos, q0, k0, cos, sin)
    store_kv_triton(k0, v0, kc_ref, vc_ref, slots, k_scale, v_scale)
    as_bytes = (lambda t: t.view(torch.uint8)) if kc.dtype.itemsize == 1 else (lambda t: t)
    assert torch.equal(as_bytes(vc), as_bytes(vc_ref)), "v is stored as the store kernel does"
    if not qk_norm:  # the same operations in the same order: the same bits
        assert torch.equal(q, q0), "q differs from the rotary kernel's"
        assert torch.equal(as_bytes(kc), as_bytes(kc_ref)), "k differs from the rotary + store kernels'"
        return
    # the norm's sum of squares is added in another order: an ulp here and there
    _close(q, q0, NORM_ROPE_TOL, "q vs the unfused kernels")
    _cache_close(kc, kc_ref, k_scale, "k cache vs the unfused kernels", dtype, NORM_ROPE_TOL)


def check_attention_layer_fused(device, dtype, arch, seed=0, decodes_only=False):
    """A Llama / Qwen3 attention layer with PAGEDLLM_FUSED_ROPE_KV=1 against the same layer
    unfused, on a batch of decodes, a prefill over a cached prefix and padding (slot -1): the
    output and both caches. On the CPU the layer's own rule keeps the unfused path (no CUDA
    tensor), so the check turns the fused one on there, where it runs the op's torch reference
    (the kernel has its own checks above) and the Triton backend's `attend` under the
    interpreter: what is checked there is the layer's wiring. decodes_only: a step of three decodes,
    which the backend's `attend_decodes_qkv` must take (the decode kernel norming, rotating and
    storing itself, on by default) -- the layer's rule for it and what it hands the kernel."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tiny_models import tiny_config
    from test_kernels import make_batch

    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.distributed import SINGLE
    from pagedllm.model.models.llama import LlamaAttention
    from pagedllm.model.models.qwen3 import Qwen3Attention

    cfg = tiny_config(arch, heads=4, kv_heads=2, hidden=64, head_dim=16)
    cls = Qwen3Attention if arch == "qwen3" else LlamaAttention
    old = os.environ.get("PAGEDLLM_FUSED_ROPE_KV")
    try:
        os.environ["PAGEDLLM_FUSED_ROPE_KV"] = "1"
        with torch.device(device):
            fused = cls(cfg, SINGLE)
        os.environ["PAGEDLLM_FUSED_ROPE_KV"] = "0"
        with torch.device(device):
            plain = cls(cfg, SINGLE)
    finally:
        if old is None:
            os.environ.pop("PAGEDLLM_FUSED_ROPE_KV")
        else:
            os.environ["PAGEDLLM_FUSED_ROPE_KV"] = old
    assert fused.fuse_rope_kv and not plain.fuse_rope_kv
    g = torch.Generator().manual_seed(seed)
    for p in fused.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    plain.load_state_dict(fused.state_dict())
    fused, plain = fused.to(device, dtype), plain.to(device, dtype)
    block_size = 16
    if decodes_only:
        batch, num_blocks = make_batch([1, 1, 1], [9, 30, 20], 3, block_size, device, seed=seed)
    else:
        batch, num_blocks = make_batch([1, 1, 6], [9, 30, 20], 2, block_size, device, seed=seed, pad_tokens=2)
    x = _randn(batch.num_tokens, cfg.hidden_size, dtype=dtype, device=device, gen=g)
    caches = []
    cache_shape = (num_blocks, block_size, 2, 16)
    for layer in (fused, plain):  # both start from the same cached prefix
        kc = _randn(*cache_shape, dtype=dtype, device=device, gen=torch.Generator().manual_seed(7))
        vc = _randn(*cache_shape, dtype=dtype, device=device, gen=torch.Generator().manual_seed(8))
        layer.attn.k_cache, layer.attn.v_cache = kc, vc
        layer.attn.backend = TritonAttentionBackend()
        caches.append((layer.attn.k_cache, layer.attn.v_cache))
    if device == "cpu":
        fused.attn.can_store_qkv = lambda qkv: True
    else:
        assert fused.attn.can_store_qkv(x)
    taken = []  # what attend_decodes_qkv returned (None: it declined the step)
    attend_decodes_qkv = fused.attn.backend.attend_decodes_qkv
    fused.attn.backend.attend_decodes_qkv = lambda *a, **kw: taken.append(attend_decodes_qkv(*a, **kw)) or taken[-1]
    out = fused(batch.positions, x, batch)
    ref = plain(batch.positions, x, batch)
    assert [o is not None for o in taken] == ([True] if decodes_only else []), "the decode kernel's step"
    real = sum(batch.query_lens_cpu)  # the padding tokens' rows are left unwritten by attention
    _close(out[:real], ref[:real], LAYER_TOL, f"{arch} attention output, fused vs unfused")
    _close(caches[0][0], caches[1][0], NORM_ROPE_TOL, "k cache")
    assert torch.equal(caches[0][1], caches[1][1]), "v cache"


# ------------------------------------------------------------------------------- GPU tests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim,qk_norm,block_size", [
    (1, 32, 8, 128, False, 16),  # Llama-3.1-8B, batch 1
    (256, 16, 8, 128, True, 16),  # Qwen3-0.6B, 256 decodes
    (77, 14, 2, 64, True, 32),  # a head count no power of two, 32-token blocks
    (5, 12, 4, 80, False, 16),  # a head_dim no power of two
])  # fmt: skip
def test_qkv_rope_store(dtype, num_tokens, hq, hkv, head_dim, qk_norm, block_size):
    check_qkv_rope_store("cuda", dtype, num_tokens, hq, hkv, head_dim, block_size, qk_norm)


@pytest.mark.parametrize("cache,k_scale,v_scale", [("fp8_e4m3", 1.0, 1.0), ("fp8_e4m3", 0.05, 0.3),
                                                    ("fp8_e5m2", 0.5, 2.0)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_store_fp8_cache(cache, k_scale, v_scale, qk_norm):
    check_qkv_rope_store("cuda", torch.bfloat16, 64, 32, 8, 128, 16, qk_norm, cache, k_scale, v_scale)


@pytest.mark.parametrize("k_scale", [1.0, 0.05])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_store_fp8_k_offset(k_scale, qk_norm):
    """K stored less a per-channel offset (worker/kv_offset.py) by the kernel as by the reference."""
    check_qkv_rope_store("cuda", torch.bfloat16, 64, 32, 8, 128, 16, qk_norm, "fp8_e4m3", k_scale, 1.0,
                         k_offset=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qkv_rope_store_v_key_major(dtype):
    """A 16-bit V cache stored key-major (PAGEDLLM_V_TRANSPOSED=1): the fused store writes each
    head_dim value at its key-major place, a NaN as 0 and an infinity saturated."""
    check_qkv_rope_store("cuda", dtype, 64, 32, 8, 128, 16, True, v_key_major=True)


@pytest.mark.parametrize("block_h", [1, 2, 8, 32])
def test_qkv_rope_store_block_h(block_h):
    check_qkv_rope_store("cuda", torch.bfloat16, 9, 32, 8, 128, 16, True, block_h=block_h)


@pytest.mark.parametrize("cache", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_qkv_rope_store_equals_unfused_triton(cache, qk_norm, num_tokens):
    check_qkv_rope_store_equals_unfused_triton("cuda", torch.bfloat16, num_tokens, 32, 8, 128, 16, qk_norm, cache,
                                               0.1 if cache != "auto" else 1.0, 0.2 if cache != "auto" else 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("decodes_only", [False, True])
def test_attention_layer_fused(dtype, arch, decodes_only):
    check_attention_layer_fused("cuda", dtype, arch, decodes_only=decodes_only)


# ------------------------------------------------------------------------ the engine, on and off


def _tiny(arch, tmp_path, tokenizer_dir):
    from tiny_models import save_tiny_model, tiny_config

    cfg = tiny_config(arch, heads=4, kv_heads=2, hidden=128, head_dim=32 if arch == "qwen3" else None)
    return save_tiny_model(cfg, str(tmp_path), tokenizer_dir, seed=3)


def _prompts():
    import random

    rng = random.Random(1)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in (1, 7, 30, 64, 100, 5)]


def _generate(path, monkeypatch, env, prompts, **kwargs):
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_KV", env.get("PAGEDLLM_FUSED_ROPE_KV", "0"))
    monkeypatch.setenv("PAGEDLLM_FUSED_ROPE_DECODE", env.get("PAGEDLLM_FUSED_ROPE_DECODE", "0"))
    args = dict(max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16, max_num_batched_tokens=64,
                block_size=16)
    llm = LLM(path, **{**args, **kwargs})
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_fused_rope_kv_greedy(tmp_path, tokenizer_dir, monkeypatch, arch, kv_cache_dtype):
    """float32 with the fused kernel on: the tokens of the unfused path, which equal
    transformers' (tests/gpu/test_engine_gpu.py); with an FP8 cache, those of the unfused
    FP8-cache path. CUDA graphs on (decodes) and prefill chunks both run the fused kernel."""
    path = _tiny(arch, tmp_path, tokenizer_dir)
    prompts = _prompts()
    off = _generate(path, monkeypatch, {}, prompts, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    on = _generate(path, monkeypatch, {"PAGEDLLM_FUSED_ROPE_KV": "1"}, prompts, dtype="float32",
                   kv_cache_dtype=kv_cache_dtype)
    assert on == off
    if kv_cache_dtype == "auto":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        for p, o in zip(prompts, on):
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert o == ref


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_fp8_rows_greedy(tmp_path, tokenizer_dir, monkeypatch, arch):
    """FP8 weights on a bfloat16 model: the norms and the gated activation writing the W8A8
    products' FP8 rows themselves (the default) give the tokens of the separate quantization
    kernel (PAGEDLLM_FUSED_NORM_FP8=0, PAGEDLLM_FUSED_ACT_FP8=0); the 64-row prefill chunks take
    the fused kernels (counted), the decodes below 64 rows do not."""
    import collections

    from pagedllm.model.layers import activation, layernorm

    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(layernorm, "rms_norm_fp8", counted("norm", layernorm.rms_norm_fp8))
    monkeypatch.setattr(activation, "act_and_mul_fp8", counted("act", activation.act_and_mul_fp8))
    path = _tiny(arch, tmp_path, tokenizer_dir)
    prompts = _prompts()
    outs = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_FUSED_NORM_FP8", fused)
        monkeypatch.setenv("PAGEDLLM_FUSED_ACT_FP8", fused)
        calls.clear()
        outs[fused] = _generate(path, monkeypatch, {}, prompts, dtype="bfloat16", quantization="fp8")
        assert (calls["norm"] > 0 and calls["act"] > 0) == (fused == "1"), dict(calls)
    assert outs["1"] == outs["0"]
