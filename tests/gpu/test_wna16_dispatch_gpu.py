"""`wna16_linear`, the engine's dispatch over the K-packed layout's integer kernels (CUDA; skipped
without it): at every row-count class (gemvp, the dot GEMM, kpairs, the dequantized weight), on the
plain and the steps-permuted layouts, under a CUDA graph, and with its switches
(PAGEDLLM_WNA16_KPAIRS_FROM, PAGEDLLM_KPAIRS_STREAM_K, PAGEDLLM_WNA16_DENSE_FROM) against the torch
reference; the kernels themselves: test_wna16_gpu.py, whose weights and tolerances this file shares.

The `check_*` functions take a device, so tests/unit/test_wna16_kpairs_interpret.py runs them on the
CPU through Triton's interpreter at small shapes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_wna16_gpu import HAS_CUDA, _close, _weights  # noqa: E402

from pagedllm.kernels.wna16 import kperm_pack, wna16_linear, wna16_linear_torch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


def _restore_env(name, old):
    """Puts an environment variable back as it was (old None: unset)."""
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


def check_wna16_dispatch(device, dtype, n, k, rows, group_k=128, symmetric=False, kpairs_from=None, stream_k=False):
    """wna16_linear, the engine's dispatch (gemvp, the dot GEMM, kpairs from kpairs_from rows, the
    dequantized weight), at each of `rows` on the plain and the steps-permuted K-packed layouts
    against the reference on the plain one; on the CPU the CUDA dispatch, run by Triton's
    interpreter. float32 rows: kpairs multiplies them as fp16 operands (fp16's tolerance).
    stream_k: with PAGEDLLM_KPAIRS_STREAM_K=1 (kpairs' 128- / 256-row tiles stream-K where a wave
    would idle)."""
    from pagedllm.kernels import wna16, wna16_kpairs_triton

    g = torch.Generator().manual_seed(0)
    qw, s, z = _weights(n, k, 4, group_k, symmetric, device, g)
    qk = kperm_pack(qw)
    tol = torch.float16 if dtype == torch.float32 else dtype
    old_from, old_use = os.environ.get("PAGEDLLM_WNA16_KPAIRS_FROM"), wna16.use_triton
    old_sk = os.environ.get("PAGEDLLM_KPAIRS_STREAM_K")
    os.environ["PAGEDLLM_WNA16_KPAIRS_FROM"] = "" if kpairs_from is None else str(kpairs_from)
    os.environ["PAGEDLLM_KPAIRS_STREAM_K"] = "1" if stream_k else "0"
    wna16.kpairs_min_rows.cache_clear()
    wna16_kpairs_triton.stream_k_enabled.cache_clear()
    if device == "cpu":
        wna16.use_triton = lambda x: True
    try:
        for m in rows:
            x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
            ref = wna16_linear_torch(x, qw, s, z, 4)
            _close(wna16_linear(x, qw, s, z, 4), ref, tol)
            _close(wna16_linear(x, qk, s, z, 4, kperm=True), ref, tol)
    finally:
        wna16.use_triton = old_use
        _restore_env("PAGEDLLM_WNA16_KPAIRS_FROM", old_from)
        _restore_env("PAGEDLLM_KPAIRS_STREAM_K", old_sk)
        wna16.kpairs_min_rows.cache_clear()
        wna16_kpairs_triton.stream_k_enabled.cache_clear()


def check_wna16_dense_from(device, dtype, n, k, rows, value):
    """PAGEDLLM_WNA16_DENSE_FROM=value: wna16_linear at each of `rows` is bit for bit the dequantized
    weight's GEMM (x @ dequantize_wna16_triton) where the rows reach ROWS and the weight has at most
    WEIGHTS values, else kpairs' direct call (below SWAP_GEMM_MAX_ROWS rows) -- and within tolerance
    of the reference either way; on the CPU the CUDA dispatch, run by Triton's interpreter."""
    from pagedllm.kernels import wna16
    from pagedllm.kernels.wna16_kpairs_triton import wna16_kpairs_gemm
    from pagedllm.kernels.wna16_triton import dequantize_wna16_triton

    g = torch.Generator().manual_seed(0)
    qw, s, z = _weights(n, k, 4, 128, False, device, g)
    tol = torch.float16 if dtype == torch.float32 else dtype
    old_value, old_use = os.environ.get("PAGEDLLM_WNA16_DENSE_FROM"), wna16.use_triton
    os.environ["PAGEDLLM_WNA16_DENSE_FROM"] = value
    wna16.dense_from.cache_clear()
    if device == "cpu":
        wna16.use_triton = lambda x: True
    try:
        from_rows, weights = wna16.dense_from()
        for m in rows:
            x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
            out = wna16_linear(x, qw, s, z, 4)
            if m >= from_rows and n * k <= weights:
                assert torch.equal(out, x @ dequantize_wna16_triton(qw, s, z, 4, x.dtype)), (m, "dense")
            else:
                assert torch.equal(out, wna16_kpairs_gemm(x, qw, s, z)), (m, "kpairs")
            _close(out, wna16_linear_torch(x, qw, s, z, 4), tol)
    finally:
        wna16.use_triton = old_use
        _restore_env("PAGEDLLM_WNA16_DENSE_FROM", old_value)
        wna16.dense_from.cache_clear()


@pytest.mark.parametrize("value", ["128", "64:20000000"])
def test_wna16_linear_dispatch_dense_from(value):
    """PAGEDLLM_WNA16_DENSE_FROM at Llama-3.1-8B's o (16.8M weights: dense from the bound's rows) and
    gate/up (117M: kpairs at both bounds), 48-256 rows."""
    for n, k in ((4096, 4096), (28672, 4096)):
        check_wna16_dense_from("cuda", torch.bfloat16, n, k, [48, 64, 128, 256], value)


@pytest.mark.parametrize("m", [1, 3, 8, 47, 48, 300])
def test_wna16_linear_dispatch(m):
    g = torch.Generator().manual_seed(m)
    qw, s, z = _weights(4096, 4096, 4, 128, False, "cuda", g)
    x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    _close(wna16_linear(x, qw, s, z, 4), wna16_linear_torch(x, qw, s, z, 4), torch.bfloat16)


@pytest.mark.parametrize("m", [2, 4, 5, 16, 33, 47])
def test_wna16_linear_dispatch_kpairs_from(m, monkeypatch):
    """PAGEDLLM_WNA16_KPAIRS_FROM=2: the few-row products go through kpairs (its 16- / 32- / 64-row
    tiles; bit for bit a direct call of it), on both layouts, within tolerance of the reference."""
    from pagedllm.kernels import wna16
    from pagedllm.kernels.wna16_kpairs_triton import wna16_kpairs_gemm

    monkeypatch.setenv("PAGEDLLM_WNA16_KPAIRS_FROM", "2")
    wna16.kpairs_min_rows.cache_clear()
    try:
        g = torch.Generator().manual_seed(m)
        qw, s, z = _weights(6144, 4096, 4, 128, False, "cuda", g)
        x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
        ref = wna16_linear_torch(x, qw, s, z, 4)
        out = wna16_linear(x, qw, s, z, 4)
        assert torch.equal(out, wna16_kpairs_gemm(x, qw, s, z))
        _close(out, ref, torch.bfloat16)
        _close(wna16_linear(x, kperm_pack(qw), s, z, 4, kperm=True), ref, torch.bfloat16)
    finally:
        wna16.kpairs_min_rows.cache_clear()


@pytest.mark.parametrize("kperm", [False, True])
def test_wna16_under_cuda_graph(kperm):
    """Replayed from a CUDA graph (decode steps are) with new inputs copied in: split-K's zeroed
    buffer and the GEMM are recorded, so the replay equals an eager call on the new inputs; in
    the plain and the steps-permuted layouts."""
    g = torch.Generator().manual_seed(0)
    qw, s, z = _weights(4096, 4096, 4, 128, True, "cuda", g)
    qk = kperm_pack(qw) if kperm else qw
    for m in (1, 16, 32, 128):
        x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
        wna16_linear(x, qk, s, z, 4, kperm=kperm)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = wna16_linear(x, qk, s, z, 4, kperm=kperm)
        x.copy_(torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, wna16_linear_torch(x, qw, s, z, 4), torch.bfloat16)


@pytest.mark.parametrize("m", [1, 3, 16, 47, 48, 200, 256, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (3584, 3584), (4608, 3584)])
@pytest.mark.parametrize("group_k,symmetric", [(128, False), (None, True)])
def test_wna16_kperm_dispatch(m, n, k, group_k, symmetric):
    """The steps-permuted layout through wna16_linear at every row-count class (gemvp's PTX at its
    configs, the dot GEMM, kpairs reading x as it is at its 64- / 128- / 256-row tiles, the weight
    dequantized to its inputs' rows), bf16, against the reference on the plain layout; Llama-3.1-8B's
    shapes and Qwen2.5-7B's o and q/k/v, whose 3,584 inputs are no multiple of gemvp's 1,024-input tiles."""
    g = torch.Generator().manual_seed(m)
    qw, s, z = _weights(n, k, 4, group_k, symmetric, "cuda", g)
    x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", torch.bfloat16)
    _close(wna16_linear(x, kperm_pack(qw), s, z, 4, b, kperm=True), wna16_linear_torch(x, qw, s, z, 4, b),
           torch.bfloat16)
