"""The kernel options the new architectures need, on the GPU against their torch references:
sliding-window and soft-capped paged attention (decode with split-K, prefill over cached
prefixes, the whole backend, a captured decode), GeGLU's GELU(tanh)-and-mul, and the rotary
caches of the scaled rope types through the Triton rotary kernel."""

from __future__ import annotations

import pytest
import torch

from test_kernels import (
    ATTENTION_TOL,
    ELEMENTWISE_TOL,
    HAS_CUDA,
    _close,
    check_backend,
    check_decode,
    check_gelu_tanh_and_mul,
    check_prefill,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

OPTIONS = [(100, None), (None, 50.0), (64, 30.0)]  # (sliding_window, logits_soft_cap)
DTYPES = [torch.bfloat16, torch.float32]  # fp16 shares bf16's code paths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,cap", OPTIONS)
def test_decode_window_soft_cap(dtype, window, cap):
    seq_lens = [1, 17, 250, 5000, 1000, 33]
    for splits in (1, None):
        check_decode("cuda", dtype, seq_lens, 16, 8, 256, 16, num_splits=splits, sliding_window=window,
                     logits_soft_cap=cap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,cap", OPTIONS)
def test_prefill_window_soft_cap(dtype, window, cap):
    pairs = [(100, 612), (1, 50), (256, 256), (37, 5037), (130, 4226)]
    check_prefill("cuda", dtype, [p[0] for p in pairs], [p[1] for p in pairs], 32, 32, 96, 16,
                  sliding_window=window, logits_soft_cap=cap)


@pytest.mark.parametrize("window,cap", OPTIONS)
def test_backend_window_soft_cap(window, cap):
    check_backend("cuda", torch.bfloat16, [1, 1, 1, 300, 64, 7], [5, 129, 4000, 300, 1064, 519], 3, 16, 8, 256, 16,
                  pad_tokens=2, sliding_window=window, logits_soft_cap=cap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(dtype):
    for t, d in [(1, 64), (9, 1000), (200, 14336)]:
        check_gelu_tanh_and_mul("cuda", dtype, t, d)


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0 + i / 4 for i in range(48)],
     "original_max_position_embeddings": 4096, "max_position_embeddings": 131072, "max_model_len": 8192},
    {"rope_type": "dynamic", "factor": 2.0, "max_model_len": 8192},
])
def test_scaled_rotary_caches_through_the_triton_kernel(params):
    """Scaling only fills the cos/sin cache differently (YaRN/LongRoPE scale it): the Triton
    rotary kernel applied with it equals the torch reference, in bf16 and float32."""
    from pagedllm.kernels.rotary import apply_rotary_torch
    from pagedllm.kernels.rotary_triton import apply_rotary_triton
    from pagedllm.model.layers.rotary import RotaryEmbedding

    full = {"rope_theta": 10000.0, "max_position_embeddings": 4096, "max_model_len": 16384, **params}
    rope = RotaryEmbedding(96, 8192, full).cuda()
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 8192, (77,), generator=g).cuda()
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(77, 32, 96, generator=g).to("cuda", dtype)
        k = torch.randn(77, 8, 96, generator=g).to("cuda", dtype)
        got = apply_rotary_triton(pos, q, k, rope.cos_cache, rope.sin_cache)
        ref = apply_rotary_torch(pos, q, k, rope.cos_cache, rope.sin_cache)
        for a, b in zip(got, ref):
            _close(a, b, ELEMENTWISE_TOL, f"rotary {params['rope_type']}")


def test_window_decode_under_cuda_graph():
    """A sliding-window, soft-capped decode captured once replays right after the lengths grow."""
    from pagedllm.attention.torch_backend import TorchAttentionBackend
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from test_kernels import _attention_inputs, make_batch

    dtype, hq, hkv, d, bs, w, cap = torch.bfloat16, 16, 8, 256, 16, 100, 50.0
    seq_lens = [10, 700, 3000, 45]
    batch, num_blocks = make_batch([1] * 4, seq_lens, 4, bs, "cuda", seed=3)
    batch.max_seq_len = 8192
    q, k, v, k_cache, v_cache = _attention_inputs(batch, num_blocks + 600, bs, hq, hkv, d, dtype, "cuda", 3)
    backend = TritonAttentionBackend()
    opts = dict(sliding_window=w, logits_soft_cap=cap)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, k_cache, v_cache, batch, d**-0.5, **opts)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, batch, d**-0.5, **opts)
    nxt, _ = make_batch([1] * 4, [s + 1 for s in seq_lens], 4, bs, "cuda", seed=4)
    batch.seq_lens.copy_(nxt.seq_lens)
    batch.block_tables.zero_()
    batch.block_tables[:, : nxt.block_tables.shape[1]].copy_(nxt.block_tables)
    batch.slot_mapping.copy_(nxt.slot_mapping)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    graph.replay()
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, nxt, d**-0.5, **opts)
    torch.cuda.synchronize()
    _close(out, ref, ATTENTION_TOL, "window graph replay")
