"""The decode attention kernel doing qkv_rope's work itself (attention_decode.py's ROPE, on by
default, PAGEDLLM_FUSED_ROPE_DECODE=0 off) against the two-kernel chain's torch reference (CUDA; skipped
without it): the kernel at Llama / Qwen3-30B-A3B shapes, mixed contexts, split-K both ways and
graph padding; under a CUDA graph; the engine's float32 tokens. The `check_*` function takes a
device, so tests/unit/test_fused_interpret.py runs it on the CPU under Triton's interpreter."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fused_gpu import HAS_CUDA, NORM_ROPE_TOL, _generate, _prompts, _tiny  # noqa: E402
from test_kernels import ELEMENTWISE_TOL, _close, _randn, _rope_cache  # noqa: E402

from pagedllm.kernels.qkv_rope import qkv_norm_rope_store_torch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


def check_decode_rope(device, dtype, seq_lens, hq, hkv, head_dim, block_size, qk_norm=False, num_splits=None,
                      order=None, last_reduce=None, sliding_window=None, pad=0, preload=None, seed=0):  # fmt: skip
    """The decode kernel doing qkv_rope's work (DecodeRope): from a step's qkv rows it norms and
    rotates q, stores each request's new K/V into the cache and attends. Against qkv_rope's torch
    reference followed by paged attention: the output within the attention tolerance, the new
    keys within the norm / rotary one and the new values equal, every other cache slot unchanged.
    `pad` rows of CUDA-graph padding (seq_len 0, slot -1) store nothing and give zeros; `order`
    "desc" the programs taking the requests longest first; `preload` each split's first tile
    loaded before the kernel computes the new key (None: the kernel's rule) -- the cache's slot of
    the new key holds random values before, which the output must not see."""
    from test_kernels import ATTENTION_TOL, make_batch

    from pagedllm.attention.torch_backend import paged_attention_torch
    from pagedllm.kernels.attention_decode import decode_attention_triton
    from pagedllm.kernels.qkv_rope import DecodeRope

    b = len(seq_lens)
    batch, num_blocks = make_batch([1] * b, seq_lens, b, block_size, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    cos, sin = (c.to(device) for c in _rope_cache(4096, head_dim))
    qkv = _randn(b + pad, (hq + 2 * hkv) * head_dim, dtype=dtype, device=device, gen=g)
    kc = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device, gen=g)
    vc = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device, gen=g)
    norms = ((_randn(head_dim, dtype=dtype, device=device, gen=g) * 0.1 + 1,
              _randn(head_dim, dtype=dtype, device=device, gen=g) * 0.1 + 1) if qk_norm else (None, None))  # fmt: skip
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = qkv_norm_rope_store_torch(qkv[:b], batch.positions, cos, sin, kc_ref, vc_ref, batch.slot_mapping, hq, hkv,
                                      head_dim, *norms, 1e-6)  # fmt: skip
    ref = paged_attention_torch(q_ref, kc_ref, vc_ref, batch, head_dim**-0.5, sliding_window=sliding_window)

    def padded(t, value):  # the padding rows after the requests' own
        return torch.cat([t, torch.full((pad, *t.shape[1:]), value, dtype=t.dtype, device=device)])

    seq_lens_t = padded(batch.seq_lens, 0)
    slots = padded(batch.slot_mapping, -1)
    rope = DecodeRope(padded(batch.positions, 0), cos, sin, slots, *norms, 1e-6)
    order_t = torch.argsort(seq_lens_t, descending=True).to(torch.int32) if order == "desc" else None
    out = torch.full((b + pad, hq, head_dim), float("nan"), dtype=dtype, device=device)
    before = qkv.clone()
    decode_attention_triton(
        qkv[:, : hq * head_dim].view(b + pad, hq, head_dim), kc, vc, padded(batch.block_tables, 0), seq_lens_t,
        out, head_dim**-0.5, max_seq_len=max(seq_lens), num_splits=num_splits, order=order_t,
        last_reduce=last_reduce, sliding_window=sliding_window, rope=rope, preload=preload,
    )  # fmt: skip
    _close(out[:b], ref, ATTENTION_TOL, f"decode with rope, splits={num_splits}, preload={preload}")
    assert torch.equal(out[b:], torch.zeros_like(out[b:])), "padding rows"
    assert torch.equal(qkv, before), "qkv must not be written"
    new = batch.slot_mapping
    flat, flat_ref = kc.view(-1, hkv, head_dim), kc_ref.view(-1, hkv, head_dim)
    _close(flat[new], flat_ref[new], NORM_ROPE_TOL if qk_norm else ELEMENTWISE_TOL, "the new keys")
    assert torch.equal(vc.view(-1, hkv, head_dim)[new], vc_ref.view(-1, hkv, head_dim)[new]), "the new values"
    kept = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    kept[new] = False
    assert torch.equal(flat[kept], flat_ref[kept]), "a key slot nobody writes was changed"
    assert torch.equal(vc.view(-1, hkv, head_dim)[kept], vc_ref.view(-1, hkv, head_dim)[kept]), "a value slot"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens,hq,hkv,qk_norm,opts", [
    ([400], 32, 8, False, {}),  # Llama-3.1-8B at W2's context, batch 1 (the defaults' splits)
    ([300], 32, 4, True, {"pad": 3}),  # Qwen3-30B-A3B, batch 1 in a graph of 4
    ([1, 17, 700, 64, 2049, 130], 32, 4, True, {"order": "desc"}),  # mixed contexts, longest first
    ([1, 17, 700, 64], 16, 8, True, {"num_splits": 9, "last_reduce": False}),  # the reduce kernel
    ([1, 17, 700, 64], 16, 8, False, {"num_splits": 5, "last_reduce": True, "sliding_window": 100}),
    # the first tile before the PDL wait, forced on: one tile a split (the new key in it, at its
    # end or inside), several (the new key in a later tile), with the reduce kernel and with padding
    ([300], 32, 4, True, {"num_splits": 32, "preload": True}),
    ([1, 17, 700, 64, 2049, 130], 32, 8, True, {"order": "desc", "preload": True, "pad": 2}),
    ([1, 17, 700, 64], 16, 8, False, {"num_splits": 9, "last_reduce": False, "preload": True,
                                      "sliding_window": 100}),
])  # fmt: skip
def test_decode_rope(dtype, seq_lens, hq, hkv, qk_norm, opts):
    check_decode_rope("cuda", dtype, seq_lens, hq, hkv, 128, 16, qk_norm, **opts)


def test_decode_rope_under_cuda_graph():
    """Captured once, replayed for steps at growing positions (the decode graphs' use): each
    replay stores its new keys and attends over them as an eager call does."""
    from pagedllm.kernels.attention_decode import decode_attention_triton
    from pagedllm.kernels.qkv_rope import DecodeRope

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 32, 4, 128, 16
    cos, sin = (c.to("cuda") for c in _rope_cache(4096, d))
    kc = _randn(40, bs, hkv, d, dtype=torch.bfloat16, device="cuda", gen=g)
    vc = _randn(40, bs, hkv, d, dtype=torch.bfloat16, device="cuda", gen=g)
    tables = torch.arange(1, 33, dtype=torch.int32, device="cuda").view(2, 16)
    qkv = torch.empty(2, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.empty(2, dtype=torch.int32, device="cuda")
    pos = torch.empty(2, dtype=torch.int64, device="cuda")
    slots = torch.empty(2, dtype=torch.int64, device="cuda")
    out = torch.empty(2, hq, d, dtype=torch.bfloat16, device="cuda")

    def step(n):  # request 0 at n keys, request 1 at 2n
        lens = torch.tensor([n, 2 * n], dtype=torch.int32, device="cuda")
        seq_lens.copy_(lens)
        pos.copy_(lens - 1)
        slots.copy_(tables.gather(1, ((lens - 1) // bs).long()[:, None])[:, 0].long() * bs + (lens - 1) % bs)
        qkv.copy_(_randn(*qkv.shape, dtype=torch.bfloat16, device="cuda", gen=g))

    def run():
        decode_attention_triton(qkv[:, : hq * d].view(2, hq, d), kc, vc, tables, seq_lens, out, d**-0.5,
                                max_seq_len=256, rope=DecodeRope(pos, cos, sin, slots, None, None, 0.0))  # fmt: skip

    step(10)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for n in (20, 77, 128):
        step(n)
        kc_eager, vc_eager = kc.clone(), vc.clone()
        graph.replay()
        replayed, k_replayed, v_replayed = out.clone(), kc.clone(), vc.clone()
        kc.copy_(kc_eager)
        vc.copy_(vc_eager)
        run()
        assert torch.equal(replayed, out) and torch.equal(k_replayed, kc) and torch.equal(v_replayed, vc)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_rope_in_decode_greedy(tmp_path, tokenizer_dir, monkeypatch, arch):
    """PAGEDLLM_FUSED_ROPE_DECODE=1 (float32): the decode steps (CUDA graphs, 1-6 requests) norm,
    rotate and store inside the decode kernel (its calls with DecodeRope counted) and give the
    tokens of the two-kernel path and of transformers; prefill chunks keep the two kernels. The
    small grids take their first KV tile before the PDL wait (PRELOAD, the default); with
    PAGEDLLM_DECODE_PRELOAD=0 they do not, and give the same tokens."""
    from pagedllm.kernels import attention_decode
    from pagedllm.attention import triton_backend

    calls = []
    real = triton_backend.decode_attention_triton

    def counted(*args, **kwargs):
        calls.append(kwargs.get("rope") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention_triton", counted)
    rule, preloads = attention_decode.decode_preload, []
    monkeypatch.setattr(attention_decode, "decode_preload", lambda *a: preloads.append(rule(*a)) or preloads[-1])
    monkeypatch.delenv("PAGEDLLM_DECODE_PRELOAD", raising=False)
    attention_decode._preload_on.cache_clear()
    path = _tiny(arch, tmp_path, tokenizer_dir)
    prompts = _prompts()
    outs = {}
    for on in ("0", "1"):
        calls.clear()
        outs[on] = _generate(path, monkeypatch, {"PAGEDLLM_FUSED_ROPE_KV": "1", "PAGEDLLM_FUSED_ROPE_DECODE": on},
                             prompts, dtype="float32")  # fmt: skip
        assert any(calls) == (on == "1") and not all(calls), (on, len(calls), sum(calls))
    assert outs["1"] == outs["0"] and any(preloads)
    preloads.clear()
    monkeypatch.setenv("PAGEDLLM_DECODE_PRELOAD", "0")
    attention_decode._preload_on.cache_clear()
    try:
        outs["nopreload"] = _generate(path, monkeypatch, {"PAGEDLLM_FUSED_ROPE_KV": "1",
                                                          "PAGEDLLM_FUSED_ROPE_DECODE": "1"}, prompts, dtype="float32")
    finally:
        attention_decode._preload_on.cache_clear()
    assert preloads and not any(preloads) and outs["nopreload"] == outs["0"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for p, o in zip(prompts, outs["1"]):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o == ref
