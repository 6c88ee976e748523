"""The 4-bit kernels of the N-major layout (kernels/wna16_swap_triton.py, wna16_gemvn_triton.py,
the pairs kernel of wna16_pairs_triton.py) against their torch references on random inputs (CUDA;
skipped without it): the swap-AB kernel at 1-47 rows and as the GEMM, its PTX dequantization bit
for bit equal to the plain Triton one, the one-row GEMV, the N-major prefill dequantization, the
dispatch (PAGEDLLM_WNA16_GEMM=swap / pairs, the row bound), CUDA graphs, and an engine run on a
tiny GPTQ checkpoint with PAGEDLLM_WNA16_SWAP=1. Weights and tolerances: test_wna16_gpu.py.

The `check_*` functions take a device, so tests/unit/test_wna16_swap_interpret.py runs them on the
CPU through Triton's interpreter at small shapes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels import nan_past_the_end  # noqa: E402
from test_wna16_gpu import HAS_CUDA, _close, _prefetch, _weights  # noqa: E402

from pagedllm.kernels.wna16 import (  # noqa: E402
    dequantize_int4_nk_torch,
    dequantize_wna16_torch,
    quantize_wna16_torch,
    to_int4_nk,
    wna16_int4_nk_linear,
    wna16_int4_nk_linear_torch,
    wna16_linear,
    wna16_linear_torch,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


def _nk_weights(n, k, group_k, symmetric, device, gen, scale_dtype=torch.float16):
    """4-bit weights in the N-major layout; its dequantization equals the K-packed one's exactly."""
    w = torch.randn(n, k, generator=gen) * 0.05
    qw, s, z = quantize_wna16_torch(w, 4, group_k, symmetric, scale_dtype)
    qn, sn, zn = to_int4_nk(qw, s, z)
    assert qn.shape == (n, k // 8) and sn.shape == (n, s.shape[0]) and sn.stride(1) == 1
    ref = dequantize_wna16_torch(qw, s, z, 4, torch.float32)
    assert torch.equal(dequantize_int4_nk_torch(qn, sn, zn, torch.float32), ref)
    return qn.to(device), sn.to(device), None if zn is None else zn.to(device)


def check_wna16_swap(device, dtype, m, n, k, group_k=128, symmetric=True, bias=False, config=None, seed=0,
                     scale_dtype="float16", nan_past_end=False):
    """The swap-AB kernel (config: SwapConfig fields) against the float32 reference; nan_past_end:
    the scales and zeros followed by NaN (no step may read a group past K)."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig
    from pagedllm.kernels.wna16_swap_triton import wna16_swap_gemm

    g = torch.Generator().manual_seed(seed)
    qn, sn, zn = _nk_weights(n, k, group_k, symmetric, device, g, getattr(torch, scale_dtype))
    if nan_past_end:
        sn, zn = nan_past_the_end(sn, 1), None if zn is None else nan_past_the_end(zn, 1)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    out = wna16_swap_gemm(x, qn, sn, zn, b, config=SwapConfig(*config) if config else None)
    assert out.dtype == dtype and out.shape == (m, n)
    # float32 activations enter the MMA as fp16
    _close(out, wna16_int4_nk_linear_torch(x, qn, sn, zn, b), torch.float16 if dtype == torch.float32 else dtype)


def check_wna16_gemvn(device, dtype, m, n, k, group_k=128, symmetric=True, bias=False, config=None, seed=0,
                      prefetch=False):
    """The N-major one-row GEMV (config: gemvn_config's fields) against the float32 reference;
    prefetch: with PAGEDLLM_WNA16_PREFETCH=1 (the next tile's words loaded first)."""
    from pagedllm.kernels.wna16_gemvn_triton import wna16_gemvn

    g = torch.Generator().manual_seed(seed)
    qn, sn, zn = _nk_weights(n, k, group_k, symmetric, device, g, dtype)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    with _prefetch(prefetch):
        out = wna16_gemvn(x, qn, sn, zn, b, config=tuple(config) if config else None)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, wna16_int4_nk_linear_torch(x, qn, sn, zn, b), dtype)


def check_int4_nk_dequant(device, dtype, n, k, group_k=128, symmetric=True, seed=0):
    from pagedllm.kernels.wna16_swap_triton import dequantize_int4_nk_triton

    g = torch.Generator().manual_seed(seed)
    qn, sn, zn = _nk_weights(n, k, group_k, symmetric, device, g)
    out = dequantize_int4_nk_triton(qn, sn, zn, dtype)
    torch.testing.assert_close(out, dequantize_int4_nk_torch(qn, sn, zn, dtype), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (3, 1000, 2048), (16, 4096, 14336), (40, 768, 1024)])
@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False), (64, True), (None, False)])
def test_wna16_swap(dtype, m, n, k, group_k, symmetric):
    check_wna16_swap("cuda", dtype, m, n, k, group_k, symmetric, bias=m % 2 == 1)


@pytest.mark.parametrize("config", [(64, 128, 1, 4, 4), (64, 128, 4, 4, 3), (128, 128, 2, 8, 3), (32, 128, 1, 4, 4),
                                    (64, 256, 2, 4, 3), (64, 64, 8, 4, 4)])
@pytest.mark.parametrize("group_k", [128, 32])
def test_wna16_swap_configs(config, group_k):
    check_wna16_swap("cuda", torch.bfloat16, 5, 6144, 4096, group_k, False, bias=True, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_k,symmetric,block_k", [(128, True, 128), (128, False, 128), (32, False, 128),
                                                       (None, False, 128), (64, True, 256)])
def test_wna16_swap_asm_equals_plain(dtype, group_k, symmetric, block_k):
    """The PTX dequantization (lop3 / sub / fma on 16-bit pairs) gives the plain Triton path's
    values bit for bit: the same products then give the same outputs, and the prefill
    dequantization (which multiplies by the scale in float32) the same weight."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig
    from pagedllm.kernels.wna16_swap_triton import dequantize_int4_nk_triton, wna16_swap_gemm

    g = torch.Generator().manual_seed(1)
    qn, sn, zn = _nk_weights(1024, 2048, group_k, symmetric, "cuda", g, torch.bfloat16)
    x = torch.randn(7, 2048, generator=g).to("cuda", dtype)
    x_gemm = torch.randn(150, 2048, generator=g).to("cuda", dtype)  # the GEMM's tiles (the scale in the tile)
    for cfg, xs in ((SwapConfig(64, block_k, 1), x), (SwapConfig(64, block_k, 2, num_stages=3), x),
                    (SwapConfig(128, 64, 1, 8, 3, block_m=128), x_gemm),
                    (SwapConfig(128, 64, 2, 4, 3, block_m=64), x_gemm)):
        a = wna16_swap_gemm(xs, qn, sn, zn, None, cfg, asm=True)
        b = wna16_swap_gemm(xs, qn, sn, zn, None, cfg, asm=False)
        assert torch.equal(a, b), (cfg, (a.float() - b.float()).abs().max())
    assert torch.equal(dequantize_int4_nk_triton(qn, sn, zn, dtype, asm=True),
                       dequantize_int4_nk_triton(qn, sn, zn, dtype, asm=False))


@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False), (None, True)])
def test_int4_nk_dequant(group_k, symmetric):
    check_int4_nk_dequant("cuda", torch.bfloat16, 1000, 4096, group_k, symmetric)


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40, 47, 48, 300])
def test_wna16_int4_nk_dispatch(m):
    g = torch.Generator().manual_seed(m)
    qn, sn, zn = _nk_weights(4096, 4096, 128, False, "cuda", g)
    x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(4096, generator=g).to("cuda", torch.bfloat16)
    _close(wna16_int4_nk_linear(x, qn, sn, zn, b), wna16_int4_nk_linear_torch(x, qn, sn, zn, b), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1000, 2048)])
@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False), (None, True)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_wna16_gemvn(dtype, n, k, group_k, symmetric, prefetch):
    """The N-major one-row GEMV at Llama-3.1-8B's projections (and a ragged N) at its default config,
    with and without PAGEDLLM_WNA16_PREFETCH."""
    check_wna16_gemvn("cuda", dtype, 1, n, k, group_k, symmetric, bias=n == 1000, prefetch=prefetch)


@pytest.mark.parametrize("m", [48, 64, 200, 256, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False)])
def test_wna16_swap_gemm(m, n, k, group_k, symmetric):
    """The swap-AB kernel as a GEMM (64- / 128-row activation tiles, default_config) at W1's batch
    sizes on Llama-3.1-8B's projections, and at 512 rows: the sixteenth session's sweep found
    gate_up (28,672 x 4,096) wrong there in bf16 (RESULTS.md), so the engine sends it at most
    SWAP_GEMM_MAX_ROWS rows until this passes."""
    check_wna16_swap("cuda", torch.bfloat16, m, n, k, group_k, symmetric, bias=m == 48)


@pytest.mark.parametrize("m, config", [(48, (128, 64, 2, 4, 3, "kernel", 64, True)),
                                       (256, (128, 128, 1, 8, 3, "kernel", 128, True))])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False), (None, True)])
def test_wna16_swap_pairs(m, n, k, group_k, symmetric, config):
    """The pairs kernel (SwapConfig.pairs: the weight operand built in the MMA's registers) as the
    GEMM on Llama-3.1-8B's projections: a group a K step, a group a word, per channel."""
    check_wna16_swap("cuda", torch.bfloat16, m, n, k, group_k, symmetric, bias=m == 48, config=config)


@pytest.mark.parametrize("m", [48, 256, 257])
def test_wna16_linear_dispatch_pairs(m, monkeypatch):
    """PAGEDLLM_WNA16_GEMM=pairs sends the K-packed layout's 4-bit linears of DENSE_MIN_ROWS to
    SWAP_GEMM_MAX_ROWS rows to the kpairs GEMM (more to dequantize + cuBLAS), and the N-major
    layout's to the swap kernel's pairs variant; the same products, the K-packed one also replayed
    from a CUDA graph."""
    from pagedllm.kernels import wna16, wna16_kpairs_triton, wna16_swap_triton

    monkeypatch.setenv("PAGEDLLM_WNA16_GEMM", "pairs")
    wna16.large_gemm.cache_clear()
    kp, nk = [], []
    real_kp, real_nk = wna16_kpairs_triton.wna16_kpairs_gemm, wna16_swap_triton.wna16_swap_gemm
    monkeypatch.setattr(wna16_kpairs_triton, "wna16_kpairs_gemm", lambda x, *a, **kw: kp.append(x.shape[0])
                        or real_kp(x, *a, **kw))
    monkeypatch.setattr(wna16_swap_triton, "wna16_swap_gemm", lambda x, *a, **kw: nk.append(kw.get("pairs"))
                        or real_nk(x, *a, **kw))
    try:
        g = torch.Generator().manual_seed(m)
        qw, s, z = _weights(4096, 4096, 4, 128, False, "cuda", g)
        x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
        _close(wna16_linear(x, qw, s, z, 4), wna16_linear_torch(x, qw, s, z, 4), torch.bfloat16)
        assert kp == ([m] if m <= wna16.SWAP_GEMM_MAX_ROWS else []), kp
        qn, sn, zn = _nk_weights(4096, 4096, 128, False, "cuda", g)
        _close(wna16_int4_nk_linear(x, qn, sn, zn), wna16_int4_nk_linear_torch(x, qn, sn, zn), torch.bfloat16)
        assert nk == ([True] if m <= wna16.SWAP_GEMM_MAX_ROWS else []), nk
        wna16_linear(x, qw, s, z, 4)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = wna16_linear(x, qw, s, z, 4)
        x.copy_(torch.randn(x.shape, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, wna16_linear_torch(x, qw, s, z, 4), torch.bfloat16)
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_GEMM")
        wna16.large_gemm.cache_clear()


@pytest.mark.parametrize("m", [48, 200, 256, 257, 1000])
def test_wna16_int4_nk_dispatch_swap_gemm(m, monkeypatch):
    """PAGEDLLM_WNA16_GEMM=swap sends DENSE_MIN_ROWS to SWAP_GEMM_MAX_ROWS rows to the swap-AB GEMM
    and more to dequantize + cuBLAS; the same products, also replayed from a CUDA graph."""
    from pagedllm.kernels import wna16, wna16_swap_triton

    monkeypatch.setenv("PAGEDLLM_WNA16_GEMM", "swap")
    wna16.large_gemm.cache_clear()
    launched = []
    real = wna16_swap_triton.wna16_swap_gemm
    monkeypatch.setattr(wna16_swap_triton, "wna16_swap_gemm", lambda x, *a, **kw: launched.append(x.shape[0])
                        or real(x, *a, **kw))
    try:
        assert wna16.large_gemm() == "swap"
        g = torch.Generator().manual_seed(m)
        qn, sn, zn = _nk_weights(4096, 4096, 128, False, "cuda", g)
        x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
        _close(wna16_int4_nk_linear(x, qn, sn, zn), wna16_int4_nk_linear_torch(x, qn, sn, zn), torch.bfloat16)
        assert launched == ([m] if m <= wna16.SWAP_GEMM_MAX_ROWS else []), launched
        _check_replayed(x, qn, sn, zn, g)
    finally:
        monkeypatch.delenv("PAGEDLLM_WNA16_GEMM")
        wna16.large_gemm.cache_clear()


def _check_replayed(x, qn, sn, zn, g):
    """wna16_int4_nk_linear captured in a CUDA graph on x, replayed on new values of x: the
    reference's product of the new ones."""
    wna16_int4_nk_linear(x, qn, sn, zn)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = wna16_int4_nk_linear(x, qn, sn, zn)
    x.copy_(torch.randn(x.shape, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    _close(y, wna16_int4_nk_linear_torch(x, qn, sn, zn), torch.bfloat16)


def test_wna16_swap_under_cuda_graph():
    """Replayed from a CUDA graph with new inputs: the split-K workspace and the reduce are recorded
    (1 row: gemvn's)."""
    g = torch.Generator().manual_seed(0)
    qn, sn, zn = _nk_weights(4096, 14336, 128, True, "cuda", g)
    for m in (1, 16, 33):
        _check_replayed(torch.randn(m, 14336, generator=g).to("cuda", torch.bfloat16), qn, sn, zn, g)


def test_engine_swap_layout_matches_the_k_packed_layout(tmp_path, tokenizer_dir, monkeypatch):
    """A tiny GPTQ checkpoint (group 32, asymmetric) decodes on the GPU with PAGEDLLM_WNA16_SWAP=1
    (the swap-AB kernel, CUDA graphs) as with the K-packed kernels: the same first token of each
    prompt and nearly all later ones (different kernels may round a near-tie of a random model's
    logits differently, and one flipped token changes the rest)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_models import save_tiny_model, tiny_config
    from test_wna16 import FORMATS, GREEDY, PROMPTS, write_checkpoint

    from pagedllm import LLM

    cfg = tiny_config("llama", hidden=256, heads=4, kv_heads=2, layers=2, initializer_range=0.05)
    plain = save_tiny_model(cfg, str(tmp_path / "plain"), tokenizer_dir, seed=3)
    path = write_checkpoint(plain, str(tmp_path / "ckpt"), FORMATS["gptq-g32-asym"])
    tokens = {}
    for swap in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_WNA16_SWAP", swap)
        llm = LLM(path, kv_cache_memory="64MiB", max_model_len=256)
        tokens[swap] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(tokens["1"], tokens["0"], strict=True):
        assert a[0] == b[0] and sum(x == y for x, y in zip(a, b, strict=True)) >= len(b) // 2, (a, b)
