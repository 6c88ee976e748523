"""The integer weight-only kernels of the K-packed layout (W4A16 / W8A16) against their torch
references on random inputs (CUDA; skipped without it): the GEMV (with and without split-K) and the
tensor-core GEMM over 4 / 8 bits, groups of 32 / 64 / 128 and per channel, symmetric and asymmetric
zeros, ragged shapes, bias; the dequantization of the prefill path; the kpairs GEMM
(kernels/wna16_kpairs_triton.py). The `wna16_linear` dispatch over them: test_wna16_dispatch_gpu.py;
the N-major layout's kernels: test_wna16_nk_gpu.py; both share this file's weights and tolerances.

The `check_*` functions take a device, so tests/unit/test_wna16_interpret.py and
test_wna16_kpairs_interpret.py run them on the CPU through Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels import nan_past_the_end  # noqa: E402
from test_small_m_gpu import env_switch  # noqa: E402

from pagedllm.kernels.wna16 import (  # noqa: E402
    dequantize_wna16_torch,
    kperm_pack,
    quantize_wna16_torch,
    wna16_linear,
    wna16_linear_torch,
)

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

# output against the float32 reference: the output's rounding, the sum order, and (16-bit dot)
# the weight tile rounded to the activations' dtype
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}


def _weights(n, k, bits, group_k, symmetric, device, gen):
    w = torch.randn(n, k, generator=gen) * 0.05
    qw, s, z = quantize_wna16_torch(w, bits, group_k, symmetric, torch.float16)
    # round to nearest: the error is at most half a step (plus the float16 rounding of the scale)
    step = s.float().repeat_interleave(k // s.shape[0], dim=0).t()
    err = (dequantize_wna16_torch(qw, s, z, bits, torch.float32) - w).abs()
    assert bool((err <= step * 0.5 + w.abs() * 2e-3 + 1e-6).all())
    return qw.to(device), s.to(device), None if z is None else z.to(device)


def _close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    scale = ref.float().abs().max().clamp(min=1.0)
    torch.testing.assert_close(out.float() / scale, ref.float() / scale, atol=atol, rtol=rtol)


def _prefetch(on: bool):
    """PAGEDLLM_WNA16_PREFETCH=1 (gemvp's register prefetch on every shape) or 0 inside."""
    from pagedllm.kernels import wna16_triton

    return env_switch("PAGEDLLM_WNA16_PREFETCH", "1" if on else "0", wna16_triton.gemv_prefetch)


def check_wna16_gemm(device, dtype, m, n, k, bits=4, group_k=128, symmetric=True, bias=False, config=None, seed=0,
                     reduce_last=None, calls=1, prefetch=False, kperm=False):
    """reduce_last: split-K summed by the last split (True) or by float32 atomics (False);
    calls: run again on new activations (the last split leaves its counters at zero); prefetch:
    with PAGEDLLM_WNA16_PREFETCH=1 (gemvp loads the next tile's words first); kperm: the weight
    in the steps-permuted layout (against the reference on the plain one)."""
    from pagedllm.kernels import wna16_triton

    g = torch.Generator().manual_seed(seed)
    qw, s, z = _weights(n, k, bits, group_k, symmetric, device, g)
    qk = kperm_pack(qw) if kperm else qw
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    with _prefetch(prefetch):
        for _ in range(calls):
            x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
            out = wna16_triton.wna16_gemm_triton(x, qk, s, z, bits, b, config=tuple(config) if config else None,
                                                 reduce_last=reduce_last, kperm=kperm)
            assert out.dtype == dtype and out.shape == (m, n)
            _close(out, wna16_linear_torch(x, qw, s, z, bits, b), dtype)


def check_wna16_dequant(device, dtype, n, k, bits=4, group_k=128, symmetric=True, seed=0, kperm=False):
    from pagedllm.kernels.wna16_triton import dequantize_wna16_triton

    g = torch.Generator().manual_seed(seed)
    qw, s, z = _weights(n, k, bits, group_k, symmetric, device, g)
    out = dequantize_wna16_triton(kperm_pack(qw) if kperm else qw, s, z, bits, dtype, kperm)
    assert out.shape == (k, n)
    torch.testing.assert_close(out.t(), dequantize_wna16_torch(qw, s, z, bits, dtype), atol=0, rtol=0)


def check_wna16_kpairs(device, dtype, m, n, k, group_k=128, symmetric=True, bias=False, config=None, seed=0,
                       nan_past_end=False, kperm=False):
    """The K-packed layout's kpairs GEMM (config: SwapConfig fields, pairs) against the float32
    reference; nan_past_end: the scales and zeros followed by NaN; kperm: the weight in the
    steps-permuted layout, x read as it is (a strided view of it here)."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig
    from pagedllm.kernels.wna16_kpairs_triton import wna16_kpairs_gemm

    g = torch.Generator().manual_seed(seed)
    qw, s, z = _weights(n, k, 4, group_k, symmetric, device, g)
    if nan_past_end:
        s, z = nan_past_the_end(s, 0), None if z is None else nan_past_the_end(z, 0)
    x = torch.randn(m, k + 8 * kperm, generator=g).to(device=device, dtype=dtype)[:, :k]
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    out = wna16_kpairs_gemm(x, kperm_pack(qw) if kperm else qw, s, z, b, config=SwapConfig(*config) if config else None,
                            kperm=kperm)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, wna16_linear_torch(x, qw, s, z, 4, b), torch.float16 if dtype == torch.float32 else dtype)


_SHAPES = [(1, 4096, 4096), (3, 1000, 2048), (1, 4096, 14336), (2, 6144, 4096), (16, 4096, 14336), (200, 768, 1024)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", _SHAPES)
@pytest.mark.parametrize("bits,group_k,symmetric", [(4, 128, True), (4, 32, False), (4, None, False), (8, 64, True)])
def test_wna16_gemm(dtype, m, n, k, bits, group_k, symmetric):
    check_wna16_gemm("cuda", dtype, m, n, k, bits, group_k, symmetric, bias=m % 2 == 0)


@pytest.mark.parametrize("m, split", [(1, 1), (1, 4), (3, 2)])
def test_gemvp_prefetch_equals_plain(m, split):
    """PAGEDLLM_WNA16_PREFETCH=1 (the next tile's words loaded before the current tile is used)
    and a config's 3 / 4 stages (Triton's cp.async pipeline of the loop): the same bits as
    neither, split-K and a ragged K range too."""
    from pagedllm.kernels import wna16_triton

    g = torch.Generator().manual_seed(m)
    w = torch.randn(4096, 3000 // 8 * 8, generator=g) * 0.05
    qw, s, z = (t.to("cuda") if t is not None else None for t in quantize_wna16_torch(w, 4, 8 * 125, False,
                                                                                      torch.bfloat16))
    x = torch.randn(m, w.shape[1], generator=g).to("cuda", torch.bfloat16)
    outs = []
    for on, stages in ((False, 2), (True, 2), (False, 3), (False, 4)):
        with _prefetch(on):
            outs.append(wna16_triton.wna16_gemm_triton(x, qw, s, z, 4, config=("gemvp", 1, 32, 1024, 8, stages, split)))
    for out in outs[1:]:
        assert torch.equal(outs[0], out)


@pytest.mark.parametrize("group_k,tile_k", [(1024, 256), (512, 512), (128, 1024), (96, 512)])
def test_gemvp_prefetch_scale_rows(group_k, tile_k):
    """The register prefetch's scale rows as its tiles move: groups four times and once the tile (one row a
    tile), a tile of eight groups (rows moved with it), groups nesting neither way (a row per input);
    split-K and asymmetric zeros."""
    check_wna16_gemm("cuda", torch.bfloat16, 2, 4096, 6144, 4, group_k, False, bias=True,
                     config=("gemvp", 1, 32, tile_k, 8, 2, 2), prefetch=True)


@pytest.mark.parametrize("config", [("gemv", 1, 32, 512, 4, 2, 1), ("gemv", 1, 64, 1024, 8, 2, 4),
                                    ("gemv", 1, 128, 256, 4, 2, 2), ("dot", 16, 64, 64, 4, 3, 1),
                                    ("dot", 64, 128, 128, 8, 3, 1), ("dot", 128, 256, 64, 8, 3, 1),
                                    ("dotj", 64, 128, 128, 8, 3, 1), ("dotj", 128, 128, 64, 8, 4, 1)])
def test_wna16_configs(config):
    m = 1 if config[0] == "gemv" else 80
    check_wna16_gemm("cuda", torch.bfloat16, m, 6144, 4096, 4, 128, False, bias=True, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (3, 1000, 2048), (1, 4096, 14336), (2, 28672, 4096)])
@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False), (64, True), (None, False)])
@pytest.mark.parametrize("tile", [(32, 1024, 8, 1), (32, 1024, 8, 3), (32, 512, 4, 1), (64, 512, 4, 4), (128, 256, 4, 2)])
def test_wna16_gemvp(dtype, m, n, k, group_k, symmetric, tile):
    """The packed 16-bit GEMV's PTX (the interpreter runs only its Triton-op twin) against the
    torch reference: both activation types, groups and per channel, split-K, a ragged K tile (among
    the tiles gemvp_config's down (1,024 inputs split 3) and gate/up (4 warps, 512 inputs))."""
    bn, bk, warps, split = tile
    check_wna16_gemm("cuda", dtype, m, n, k, 4, group_k, symmetric, bias=m % 2 == 0,
                     config=("gemvp", 1, bn, bk, warps, 2, split))


@pytest.mark.parametrize("kind", ["gemv", "gemvp"])
@pytest.mark.parametrize("reduce_last", [True, False])
def test_wna16_gemv_split_k(kind, reduce_last):
    """Split-K of the GEMVs, summed by the last split (the default) or by atomics, three calls in
    a row (the counters back at zero after each), the down projection's shape."""
    check_wna16_gemm("cuda", torch.bfloat16, 2, 4096, 14336, 4, 128, True, bias=True,
                     config=(kind, 1, 32, 512, 4, 2, 4), reduce_last=reduce_last, calls=3)
    from pagedllm.kernels.counters import counters

    assert int(counters(torch.device("cuda"), 1).count_nonzero()) == 0


@pytest.mark.parametrize("switch", ["", "plain"])
def test_wna16_gemvp_switch(monkeypatch, switch):
    """The 4-bit linear's few-row product runs gemvp for 16-bit activations unless
    PAGEDLLM_WNA16_GEMV=plain (gemv, as float32 activations always do)."""
    from pagedllm.kernels import wna16_triton

    monkeypatch.setenv("PAGEDLLM_WNA16_GEMV", switch)
    wna16_triton.gemv_kind.cache_clear()
    try:
        assert wna16_triton.gemv_kind(torch.bfloat16) == ("gemv" if switch else "gemvp")
        assert wna16_triton.gemv_kind(torch.float32) == "gemv"
        check_wna16_gemm("cuda", torch.bfloat16, 1, 4096, 4096, 4, 128, True)
    finally:
        wna16_triton.gemv_kind.cache_clear()


@pytest.mark.parametrize("bits,group_k,symmetric", [(4, 128, True), (4, 32, False), (8, None, False)])
def test_wna16_dequant(bits, group_k, symmetric):
    check_wna16_dequant("cuda", torch.bfloat16, 1000, 4096, bits, group_k, symmetric)


# ---- the steps-permuted K-packed layout (PAGEDLLM_WNA16_KPERM) -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("config", [("gemvp", 1, 32, 512, 8, 4, 1), ("gemvp", 1, 64, 1024, 4, 2, 3),
                                    ("gemvp", 1, 32, 1024, 8, 2, 3), ("gemvp", 1, 32, 512, 4, 2, 1),
                                    ("gemv", 1, 32, 512, 4, 2, 2), ("dot", 16, 32, 64, 4, 3, 1),
                                    ("dotj", 64, 128, 128, 8, 3, 1)])
def test_wna16_kperm_kernels(dtype, config):
    """Each kernel of the layout on it: fp16 gemvp (pipelined, split-K by the last split), the
    float32 gemv, the dot and dotj GEMMs."""
    if config[0] == "gemvp" and dtype == torch.float32:
        pytest.skip("gemvp takes 16-bit activations")
    check_wna16_gemm("cuda", dtype, 1 if config[0].startswith("gemv") else 40, 6144, 4096, 4, 128, False,
                     bias=True, config=config, kperm=True)


@pytest.mark.parametrize("config", [None, (64, 128, 1, 8, 3, "kernel", 128, True, "accs"),
                                    (128, 128, 2, 8, 3, "kernel", 256, True, "chain"),
                                    (128, 128, 1, 8, 3, "kernel", 128, True, "accs2")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wna16_kpairs_kperm(config, dtype):
    """kpairs on the steps-permuted layout, x a strided view read as it is: the default config and
    the dots modes, split-K too."""
    check_wna16_kpairs("cuda", dtype, 200, 4096, 14336, None, False, bias=True, config=config, kperm=True)
    check_wna16_kpairs("cuda", dtype, 96, 6144, 4096, 128, True, config=config, kperm=True)


def test_wna16_kperm_dequant():
    check_wna16_dequant("cuda", torch.bfloat16, 1000, 4096, 4, 128, False, kperm=True)


@pytest.mark.parametrize("m", [16, 40, 300])
def test_wna16_kperm_bit_for_bit(m):
    """The dot GEMM (5-47 rows) and the dequantized weight (prefill) work in input order on either
    layout, so the steps-permuted one gives the plain one's outputs bit for bit. (gemvp and kpairs
    do not: a word's eight products, a dot's 32, are other inputs on each layout, so their 16-bit
    and float32 sums round differently; test_wna16_kperm_dispatch bounds them.)"""
    g = torch.Generator().manual_seed(m)
    qw, s, z = _weights(6144, 4096, 4, 128, False, "cuda", g)
    x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    assert torch.equal(wna16_linear(x, kperm_pack(qw), s, z, 4, kperm=True), wna16_linear(x, qw, s, z, 4))


def test_engine_steps_permuted_layout_decodes_the_same_tokens(tmp_path, tokenizer_dir, monkeypatch):
    """A tiny act-order GPTQ checkpoint (groups of 128) on the GPU with PAGEDLLM_WNA16_KPERM=1 (its
    layers in the steps-permuted layout, CUDA graphs) decodes as the plain layout does: the same
    first token of each prompt (its prefill rows run the dot GEMM, bit for bit the same) and nearly
    all later ones (gemvp's sums round differently on each layout, and one flipped near-tie of a
    random model's logits changes the rest)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from test_wna16 import kperm_engine_tokens

    tokens = kperm_engine_tokens(tmp_path, tokenizer_dir, monkeypatch)
    torch.cuda.empty_cache()
    for a, b in zip(tokens["1"], tokens["0"], strict=True):
        assert a[0] == b[0] and sum(x == y for x, y in zip(a, b, strict=True)) >= len(b) // 2, (a, b)


# ---- the 4-bit swap-AB kernel -------------------------------------------------------------------


@pytest.mark.parametrize("m, dtype", [(5, torch.bfloat16), (24, torch.float16), (48, torch.bfloat16),
                                      (256, torch.bfloat16), (200, torch.float16)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("group_k,symmetric", [(128, True), (32, False), (None, True)])
def test_wna16_kpairs(m, n, k, group_k, symmetric, dtype):
    """The K-packed layout's kpairs GEMM (default_config) on Llama-3.1-8B's projections: a group a
    K step, a group a word, per channel; both 16-bit types (the PTX pairs of each); its 16- and
    32-row tiles too (PAGEDLLM_WNA16_KPAIRS_FROM)."""
    check_wna16_kpairs("cuda", dtype, m, n, k, group_k, symmetric, bias=m == 48)


@pytest.mark.parametrize("config", [(64, 128, 1, 8, 3, "kernel", 128, True, "accs"),
                                    (128, 128, 2, 8, 3, "kernel", 64, True, "accs"),
                                    (128, 128, 1, 8, 3, "kernel", 128, True, "accs2"),
                                    (128, 128, 2, 4, 3, "kernel", 64, True, "accs2"),
                                    (128, 128, 4, 4, 3, "kernel", 16, True, "accs2"),
                                    (128, 128, 1, 8, 3, "kernel", 128, True, "accs2", 132)])  # fmt: skip
@pytest.mark.parametrize("m, dtype", [(200, torch.bfloat16), (96, torch.float16)])
@pytest.mark.parametrize("n,k,group_k,symmetric", [(6144, 4096, 128, True), (4096, 14336, 32, False)])
def test_wna16_kpairs_dots(config, m, dtype, n, k, group_k, symmetric):
    """SwapConfig.dots "accs" (each of a K step's dots its own accumulator) and "accs2" (two
    accumulators; stream-K too): the wgmma groups in flight, the same products."""
    check_wna16_kpairs("cuda", dtype, m, n, k, group_k, symmetric, bias=True, config=config)


@pytest.mark.parametrize("config", [(128, 128, 1, 8, 3, "kernel", 128, True, "chain", 132),
                                    # (two stages: three of 256 rows outgrow sm_90's shared memory at group 32)
                                    (128, 128, 1, 8, 2, "kernel", 256, True, "chain", 132),
                                    (64, 128, 1, 8, 3, "kernel", 128, True, "accs", 132),
                                    (128, 128, 1, 8, 3, "kernel", 128, True, "chain", 7)])  # fmt: skip
@pytest.mark.parametrize("m, dtype", [(256, torch.bfloat16), (150, torch.float16)])
@pytest.mark.parametrize("n,k,group_k,symmetric", [(6144, 4096, 128, True), (28672, 4096, 32, False),
                                                   (4096, 14336, None, False)])  # fmt: skip
def test_wna16_kpairs_stream_k(config, m, dtype, n, k, group_k, symmetric):
    """SwapConfig.stream_k (PAGEDLLM_KPAIRS_STREAM_K): one program an SM over an equal share of the
    (tile, K step) units, shared tiles added by their last program in K order; twice in a row (the
    tile counters back at zero), the same products."""
    for _ in range(2):
        check_wna16_kpairs("cuda", dtype, m, n, k, group_k, symmetric, bias=True, config=config)
