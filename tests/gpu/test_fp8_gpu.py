"""The FP8 kernels against their torch references on random inputs (CUDA; skipped without it):
the W8A16 GEMV/GEMM, the per-token activation quantization, the `fp8_linear` dispatch (Triton
below the crossover, `_scaled_mm` from it, under a CUDA graph too), and FP8 KV caches in the
attention kernels: the Triton backend (store-KV, decode with and without split-K, prefill over
cached prefixes) against the torch backend on the same FP8 cache, and the torch backend's FP8
semantics against a float32 cache holding the dequantized values.

The `check_*` functions take a device, so tests/unit/test_fp8_interpret.py runs them on the CPU
through Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels import ATTENTION_TOL, _attention_inputs, make_batch, nan_past_the_end  # noqa: E402

from pagedllm.attention.backend import v_cache_view  # noqa: E402
from pagedllm.attention.torch_backend import TorchAttentionBackend, paged_attention_torch  # noqa: E402
from pagedllm.kernels.fp8 import (  # noqa: E402
    FP8_DTYPE,
    dequantize_fp8_torch,
    fp8_linear_torch,
    fp8_scaled_mm_torch,
    per_token_quant_torch,
    quantize_fp8_torch,
)

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

# W8A16 output against the float32 reference: only the output's rounding (and sum order) differ
GEMM_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _weights(n, k, group_k, device, gen):
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0] = 0.0  # an all-zero row must not give 0/0
    q, s = quantize_fp8_torch(w, group_k)
    assert q.dtype == FP8_DTYPE and s.shape == (n, 1 if group_k is None else -(-k // group_k))
    # the quantization error is the e4m3 rounding: at most half an ulp of 3 mantissa bits
    err = (dequantize_fp8_torch(q, s, torch.float32) - w).abs()
    assert bool((err <= w.abs() * 2**-4 + s.max() * 2**-9).all())
    return q.to(device), s.to(device)


def check_fp8_gemm(device, dtype, m, n, k, group_k=None, bias=False, config=None, seed=0, nan_past_end=False):
    """nan_past_end: the scales followed by NaN (no step may read a group past K)."""
    from pagedllm.kernels.fp8_triton import fp8_gemm_triton

    g = torch.Generator().manual_seed(seed)
    q, s = _weights(n, k, group_k, device, g)
    if nan_past_end:
        s = nan_past_the_end(s, 1)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    out = fp8_gemm_triton(x, q, s, b, config=config)
    ref = fp8_linear_torch(x, q, s, b)
    atol, rtol = GEMM_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # a strided input (a column slice of a wider tensor) reads the same rows
    wide = torch.randn(m, k + 8, generator=g).to(device=device, dtype=dtype)
    torch.testing.assert_close(fp8_gemm_triton(wide[:, :k], q, s, b, config=config),
                               fp8_linear_torch(wide[:, :k], q, s, b), atol=atol, rtol=rtol)


def check_per_token_quant(device, dtype, m, k, seed=0):
    from pagedllm.kernels.fp8_triton import per_token_quant_triton

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(device=device, dtype=dtype)
    x[0] = 0.0
    q, s = per_token_quant_triton(x)
    rq, rs = per_token_quant_torch(x)
    torch.testing.assert_close(s, rs, atol=0, rtol=1e-6)
    # a value on a rounding tie may land one e4m3 step away: compare dequantized values
    step = rs * 2**-3 * 448 / 2  # half the coarsest step of the row's range
    assert bool(((q.float() - rq.float()).abs() * s <= step).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 33, 200])
@pytest.mark.parametrize("group_k", [None, 128])
def test_fp8_gemm(dtype, m, group_k):
    check_fp8_gemm("cuda", dtype, m, 384, 512, group_k, bias=m == 3)
    check_fp8_gemm("cuda", dtype, m, 300, 520 if group_k is None else 640, group_k)  # ragged N, K


SWAP_CONFIGS = [("swap", 16, 64, 128, 4, 3), ("swap", 16, 16, 256, 4, 2, 3), ("swap", 16, 128, 128, 8, 3, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("group_k", [None, 128])
@pytest.mark.parametrize("config", SWAP_CONFIGS, ids=lambda c: "x".join(map(str, c[2:])))
def test_fp8_swap_ab(dtype, m, group_k, config):
    """The swap-AB tensor-core kernel (1-16 rows), with and without split-K, ragged N and K."""
    if group_k is not None:  # BLOCK_K must divide the scale group
        config = config[:3] + (min(config[3], group_k),) + config[4:]
    check_fp8_gemm("cuda", dtype, m, 384, 1024, group_k, bias=m == 7, config=config)
    check_fp8_gemm("cuda", dtype, m, 300, 520 if group_k is None else 640, group_k, config=config)


UNROLLED_CONFIGS = [("gemv_unrolled", 1, 8, 256, 4, 1, 2), ("gemv_unrolled", 1, 16, 128, 8, 1, 4),
                    ("gemv_unrolled", 1, 4, 512, 4, 1, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("group_k", [None, 128])
@pytest.mark.parametrize("config", UNROLLED_CONFIGS, ids=lambda c: "x".join(map(str, c[2:])))
def test_fp8_gemv_unrolled(dtype, m, group_k, config):
    """The unrolled GEMV (K a multiple of BLOCK_K * UNROLL; ragged N), bias on one case."""
    if group_k is not None:
        config = config[:3] + (min(config[3], group_k),) + config[4:]
    check_fp8_gemm("cuda", dtype, m, 384, 1024, group_k, bias=m == 3, config=config)
    check_fp8_gemm("cuda", dtype, m, 300, 2048, group_k, config=config)


@pytest.mark.parametrize("group_k", [None, 128])
def test_fp8_gemv_wide_default(group_k):
    """One row of a wide product takes the unrolled GEMV by default; a K it cannot tile the plain one."""
    from pagedllm.kernels.fp8_triton import default_config

    assert default_config(1, 16400, 1024, group_k or 0)[0] == "gemv_unrolled"
    assert default_config(1, 16400, 1000, 0)[0] == "gemv"
    check_fp8_gemm("cuda", torch.bfloat16, 1, 16400, 1024, group_k)
    if group_k is None:
        check_fp8_gemm("cuda", torch.bfloat16, 1, 16400, 1000)


def check_fp16_saturation(device, dtype, config):
    """bfloat16 activations beyond fp16's range are saturated at +-65504 (the swap-AB kernel's
    fp16 operands), not turned into inf: the output equals the reference on the clamped row."""
    from pagedllm.kernels.fp8_triton import fp8_gemm_triton
    from pagedllm.kernels.swap_gemm_triton import FP16_MAX

    g = torch.Generator().manual_seed(3)
    q, s = _weights(48, 64, None, device, g)
    x = torch.randn(2, 64, generator=g).to(device=device, dtype=dtype)
    x[0, 5], x[1, 7] = 3e5, -1e6
    out = fp8_gemm_triton(x, q, s, config=config)
    assert bool(out.float().isfinite().all())
    ref = fp8_linear_torch(x.float().clamp(-FP16_MAX, FP16_MAX).to(dtype), q, s)
    torch.testing.assert_close(out, ref, atol=1.6e-2, rtol=1.6e-2)


def test_fp16_saturation():
    check_fp16_saturation("cuda", torch.bfloat16, SWAP_CONFIGS[0])


def check_act_and_mul_fp8(device, dtype, m, d, gelu_tanh=False, seed=0):
    """The gated activation quantized per token in its own kernel: bit for bit the activation
    kernel then the quantization kernel, and within a rounding step of the torch references;
    a zero row gets the least scale."""
    from pagedllm.kernels.activation import gelu_tanh_and_mul_torch, silu_and_mul_torch
    from pagedllm.kernels.activation_triton import _act_and_mul, act_and_mul_fp8_triton
    from pagedllm.kernels.fp8 import MIN_SCALE
    from pagedllm.kernels.fp8_triton import per_token_quant_triton

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, 2 * d, generator=g) * 3).to(device=device, dtype=dtype)
    x[0] = 0.0
    q, s = act_and_mul_fp8_triton(x, gelu_tanh)
    assert q.dtype == FP8_DTYPE and q.shape == (m, d) and s.shape == (m, 1)
    uq, us = per_token_quant_triton(_act_and_mul(x, gelu_tanh))
    assert torch.equal(s, us) and torch.equal(q.view(torch.uint8), uq.view(torch.uint8))
    assert float(s[0]) == pytest.approx(MIN_SCALE) and not q[0].float().any()
    rq, rs = per_token_quant_torch((gelu_tanh_and_mul_torch if gelu_tanh else silu_and_mul_torch)(x))
    torch.testing.assert_close(s, rs, atol=0, rtol=2e-3)  # the 16-bit product's last bit may differ
    step = rs * 2**-3 * 448 / 2
    assert bool(((q.float() * s - rq.float() * rs).abs() <= 2 * step).all())


def check_rms_norm_fp8(device, dtype, m, h, residual=True, seed=0):
    """The RMSNorm (with the residual add, or without) quantized per token in its own kernel: the
    norm kernel then the quantization kernel's scales and residual sum bit for bit, their e4m3
    values too but for a value at a rounding boundary (the H100 found 1 of 286,720 float16 values,
    y / s = -49.957 between -48 and -52, taken the other way: the compiled sum of squares may add in
    another order when the kernel also quantizes), and within a rounding step of the torch
    references."""
    from pagedllm.kernels.fp8_triton import per_token_quant_triton
    from pagedllm.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
    from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_fp8_triton, rms_norm_triton

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 2).to(device=device, dtype=dtype)
    r = torch.randn(m, h, generator=g).to(device=device, dtype=dtype) if residual else None
    w = (torch.rand(h, generator=g) + 0.5).to(device=device, dtype=dtype)
    (q, s), res = rms_norm_fp8_triton(x, r, w, 1e-6)
    assert q.dtype == FP8_DTYPE and q.shape == (m, h) and s.shape == (m, 1)
    y, ures = fused_add_rms_norm_triton(x, r, w, 1e-6) if residual else (rms_norm_triton(x, w, 1e-6), None)
    uq, us = per_token_quant_triton(y)
    assert torch.equal(s, us)
    differ = q.view(torch.uint8) != uq.view(torch.uint8)
    assert int(differ.sum()) <= max(1, q.numel() // 10000), f"{int(differ.sum())} of {q.numel()} values differ"
    assert bool(((q.float() - uq.float())[differ].abs() <= uq.float()[differ].abs() / 8 + 2**-6).all())
    assert (res is None) == (not residual) and (res is None or torch.equal(res, ures))
    ry = fused_add_rms_norm_torch(x, r, w, 1e-6)[0] if residual else rms_norm_torch(x, w, 1e-6)
    rq, rs = per_token_quant_torch(ry)
    torch.testing.assert_close(s, rs, atol=0, rtol=2e-3)
    step = rs * 2**-3 * 448 / 2
    assert bool(((q.float() * s - rq.float() * rs).abs() <= 2 * step).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h, residual", [(4096, True), (4096, False), (1000, True)])
def test_rms_norm_fp8(dtype, h, residual):
    check_rms_norm_fp8("cuda", dtype, 70, h, residual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_token_quant(dtype):
    check_per_token_quant("cuda", dtype, 37, 4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, gelu_tanh", [(14336, False), (3000, True), (17, False)])
def test_act_and_mul_fp8(dtype, d, gelu_tanh):
    check_act_and_mul_fp8("cuda", dtype, 70, d, gelu_tanh)


@pytest.mark.parametrize("m", [63, 64, 300])
def test_act_into_fp8_rows(m):
    """An FP8 down projection takes the activation's FP8 rows from 64 rows (where it would quantize
    them itself): the same bits as the activation, the quantization kernel and `_scaled_mm`."""
    from pagedllm.kernels import fp8
    from pagedllm.model.layers.activation import SiluAndMul, act_into
    from pagedllm.model.layers.linear import RowParallelLinear
    from pagedllm.model.layers.quantization.fp8 import Fp8Config

    torch.manual_seed(3)
    layer = RowParallelLinear(1024, 512).to("cuda", torch.bfloat16)
    layer.weight.data.normal_(0, 0.02)
    layer.quant_method = Fp8Config().get_linear_method(layer, "down_proj")  # online: quantized after loading
    layer.quant_method.process_weights_after_loading(layer)
    h = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    assert layer.takes_fp8_rows(h) == (m >= fp8.SCALED_MM_MIN_ROWS)
    act = SiluAndMul()
    assert torch.equal(act_into(act, layer, h), layer(act(h)))


@pytest.mark.parametrize("m", [1, 8, 64, 300])
def test_fp8_linear_dispatch(m):
    """`fp8_linear` on CUDA (Triton below the crossover, `_scaled_mm` from it) against the
    reference of the product it runs."""
    from pagedllm.kernels import fp8

    g = torch.Generator().manual_seed(1)
    q, s = _weights(512, 1024, None, "cuda", g)
    x = torch.randn(m, 1024, generator=g).to("cuda", torch.bfloat16)
    ref = (fp8_scaled_mm_torch if m >= fp8.SCALED_MM_MIN_ROWS else fp8_linear_torch)(x, q, s)
    torch.testing.assert_close(fp8.fp8_linear(x, q, s), ref, atol=3e-2, rtol=3e-2)


def test_fp8_gemv_under_cuda_graph():
    from pagedllm.kernels.fp8 import fp8_linear

    g = torch.Generator().manual_seed(2)
    q, s = _weights(256, 512, None, "cuda", g)
    x = torch.randn(1, 512, generator=g).to("cuda", torch.bfloat16)
    fp8_linear(x, q, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, q, s)
    x.copy_(torch.randn(1, 512, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(y, fp8_linear_torch(x, q, s), atol=1.6e-2, rtol=1.6e-2)


# ---------------------------------------------------------------------------- FP8 KV cache

CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _fp8_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed, cache_dtype, k_scale, v_scale,
                v_contiguous=False):
    """The V cache in the engine's layout for FP8 (blocks stored [Hkv, D, bs], a strided view:
    attention/backend.py), or contiguous (v_contiguous: the kernels' other path)."""
    q, k, v, kc, vc = _attention_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed)
    # the cached prefix: values stored by earlier steps, at the cache's scales
    kc = (kc.float() * 2.0 / k_scale).to(cache_dtype)
    vc = (vc.float() * 2.0 / v_scale).to(cache_dtype)
    if not v_contiguous:
        vc = v_cache_view(torch.empty_like(vc)).copy_(vc)
        assert vc.stride(-1) == block_size
    return q, k * 2.0, v * 2.0, kc, vc


def check_fp8_reference(device, dtype, query_lens, seq_lens, num_decodes, hq, hkv, head_dim, block_size,
                        cache="fp8_e4m3", k_scale=1.0, v_scale=1.0, seed=0):
    """The torch backend on an FP8 cache = the torch backend on a float32 cache holding
    dequantized values and the new K/V rounded the way the FP8 store rounds them."""
    cd = CACHE_DTYPES[cache]
    batch, num_blocks = make_batch(query_lens, seq_lens, num_decodes, block_size, device, seed)
    q, k, v, kc, vc = _fp8_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed, cd,
                                  k_scale, v_scale)
    kf, vf = kc.float() * k_scale, vc.float() * v_scale
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, batch, head_dim**-0.5, k_scale, v_scale)
    # what the store must have written: each new value / scale, rounded to the FP8 type
    top = float(torch.finfo(cd).max)
    kr = (k.float() * (1 / k_scale)).clamp(-top, top).to(cd).float() * k_scale
    vr = (v.float() * (1 / v_scale)).clamp(-top, top).to(cd).float() * v_scale
    stored = kc.float().view(-1, hkv, head_dim)[batch.slot_mapping] * k_scale
    torch.testing.assert_close(stored, kr, atol=0, rtol=0)
    ref = TorchAttentionBackend().forward(q.float(), kr, vr, kf, vf, batch, head_dim**-0.5)
    tol = {torch.float32: (2e-4, 2e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
    atol, rtol = tol[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol * 4, rtol=rtol * 4)


def check_fp8_backend(device, dtype, query_lens, seq_lens, num_decodes, hq, hkv, head_dim, block_size,
                      cache="fp8_e4m3", k_scale=1.0, v_scale=1.0, num_splits=None, seed=0, v_contiguous=False,
                      sliding_window=None, logits_soft_cap=None, nan_token=False):
    """The Triton backend against the torch backend, both on FP8 caches: the stored bytes are
    equal and the outputs close. nan_token: the first new token's V holds a NaN, which both
    store as 0 (the kernels read whole V blocks, so no slot may hold one)."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend
    from pagedllm.kernels import attention_decode

    cd = CACHE_DTYPES[cache]
    batch, num_blocks = make_batch(query_lens, seq_lens, num_decodes, block_size, device, seed)
    q, k, v, kc, vc = _fp8_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed, cd,
                                  k_scale, v_scale, v_contiguous)
    if nan_token:
        v[0, 0, 1] = float("nan")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    assert vc_ref.stride() == vc.stride()
    opts = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    splits = attention_decode.decode_num_splits
    if num_splits is not None:
        attention_decode.decode_num_splits = lambda *a: num_splits
    try:
        out = TritonAttentionBackend().forward(q, k, v, kc, vc, batch, head_dim**-0.5, k_scale, v_scale, **opts)
    finally:
        attention_decode.decode_num_splits = splits
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, batch, head_dim**-0.5, k_scale, v_scale, **opts)
    if nan_token:
        slot = int(batch.slot_mapping[0])
        stored = vc[slot // block_size, slot % block_size, 0, 1]
        assert int(stored.view(torch.uint8)) == 0, f"a NaN in V was stored as {stored}"
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8)), "K cache bytes differ"
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8)), "V cache bytes differ"
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def check_fp8_decode(device, dtype, seq_lens, hq, hkv, head_dim, block_size, cache="fp8_e4m3", k_scale=1.0,
                     v_scale=1.0, num_splits=None, seed=0, v_contiguous=False, sliding_window=None,
                     last_reduce=None):
    """The decode kernel on an FP8 cache against the torch reference over the dequantized cache
    in float32 (a sliding window's partitions start on a block boundary, the keys below the
    window masked)."""
    from pagedllm.kernels.attention_decode import decode_attention_triton

    b = len(seq_lens)
    batch, num_blocks = make_batch([1] * b, seq_lens, b, block_size, device, seed)
    q, _, _, kc, vc = _fp8_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed,
                                  CACHE_DTYPES[cache], k_scale, v_scale, v_contiguous)  # fmt: skip
    out = torch.full_like(q, float("nan"))
    decode_attention_triton(q, kc, vc, batch.block_tables, batch.seq_lens, out, head_dim**-0.5,
                            max_seq_len=batch.max_seq_len, num_splits=num_splits, k_scale=k_scale,
                            v_scale=v_scale, sliding_window=sliding_window, last_reduce=last_reduce)  # fmt: skip
    ref = paged_attention_torch(q.float(), kc.float() * k_scale, vc.float() * v_scale, batch, head_dim**-0.5,
                                sliding_window=sliding_window)
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


MIXED = dict(query_lens=[1, 1, 1, 300, 64, 7], seq_lens=[5, 129, 3000, 300, 1064, 519], num_decodes=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", sorted(CACHE_DTYPES))
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 0.3)])
def test_fp8_backend_mixed_batch(dtype, cache, scales):
    check_fp8_backend("cuda", dtype, **MIXED, hq=32, hkv=8, head_dim=128, block_size=16, cache=cache,
                      k_scale=scales[0], v_scale=scales[1])
    check_fp8_backend("cuda", dtype, **MIXED, hq=8, hkv=8, head_dim=64, block_size=32, cache=cache,
                      k_scale=scales[0], v_scale=scales[1], num_splits=4)


@pytest.mark.parametrize("cache", sorted(CACHE_DTYPES))
def test_fp8_reference_semantics(cache):
    check_fp8_reference("cuda", torch.bfloat16, **MIXED, hq=32, hkv=8, head_dim=128, block_size=16, cache=cache,
                        k_scale=0.5, v_scale=2.0)


@pytest.mark.parametrize("cache", sorted(CACHE_DTYPES))
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8), (12, 4), (32, 4)])
def test_fp8_decode(cache, hq, hkv):
    seq_lens = [1, 17, 250, 64, 1000, 33, 2048]
    for splits in (None, 1, 4):
        check_fp8_decode("cuda", torch.bfloat16, seq_lens, hq, hkv, 128, 16, cache=cache, k_scale=0.05, v_scale=0.3,
                         num_splits=splits)
