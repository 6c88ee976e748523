"""The integer weight-only kernels (W4A16 / W8A16) against their torch references on random
inputs (CUDA; skipped without it): the GEMV (with and without split-K) and the tensor-core
GEMM over 4 / 8 bits, groups of 32 / 64 / 128 and per channel, symmetric and asymmetric zeros,
ragged shapes, bias; the dequantization of the prefill path; the `wna16_linear` dispatch at
every row count class, under a CUDA graph too.

The `check_*` functions take a device, so tests/unit/test_wna16_interpret.py runs them on the CPU
through Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.kernels.wna16 import dequantize_wna16_torch, quantize_wna16_torch, wna16_linear, wna16_linear_torch

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


def check_wna16_gemm(device, dtype, m, n, k, bits=4, group_k=128, symmetric=True, bias=False, config=None, seed=0):
    from pagedllm.kernels.wna16_triton import wna16_gemm_triton

    g = torch.Generator().manual_seed(seed)
    qw, s, z = _weights(n, k, bits, group_k, symmetric, device, g)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    out = wna16_gemm_triton(x, qw, s, z, bits, b, config=tuple(config) if config else None)
    assert out.dtype == dtype and out.shape == (m, n)
    _close(out, wna16_linear_torch(x, qw, s, z, bits, b), dtype)


def check_wna16_dequant(device, dtype, n, k, bits=4, group_k=128, symmetric=True, seed=0):
    from pagedllm.kernels.wna16_triton import dequantize_wna16_triton

    g = torch.Generator().manual_seed(seed)
    qw, s, z = _weights(n, k, bits, group_k, symmetric, device, g)
    out = dequantize_wna16_triton(qw, s, z, bits, dtype)
    assert out.shape == (k, n)
    torch.testing.assert_close(out.t(), dequantize_wna16_torch(qw, s, z, bits, dtype), atol=0, rtol=0)


_SHAPES = [(1, 4096, 4096), (3, 1000, 2048), (16, 4096, 14336), (200, 768, 1024)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", _SHAPES)
@pytest.mark.parametrize("bits,group_k,symmetric", [(4, 128, True), (4, 32, False), (4, None, False), (8, 64, True)])
def test_wna16_gemm(dtype, m, n, k, bits, group_k, symmetric):
    check_wna16_gemm("cuda", dtype, m, n, k, bits, group_k, symmetric, bias=m % 2 == 0)


@pytest.mark.parametrize("config", [("gemv", 1, 32, 512, 4, 2, 1), ("gemv", 1, 64, 1024, 8, 2, 4),
                                    ("gemv", 1, 128, 256, 4, 2, 2), ("dot", 16, 64, 64, 4, 3, 1),
                                    ("dot", 64, 128, 128, 8, 3, 1), ("dot", 128, 256, 64, 8, 3, 1)])
def test_wna16_configs(config):
    m = 1 if config[0] == "gemv" else 80
    check_wna16_gemm("cuda", torch.bfloat16, m, 6144, 4096, 4, 128, False, bias=True, config=config)


@pytest.mark.parametrize("bits,group_k,symmetric", [(4, 128, True), (4, 32, False), (8, None, False)])
def test_wna16_dequant(bits, group_k, symmetric):
    check_wna16_dequant("cuda", torch.bfloat16, 1000, 4096, bits, group_k, symmetric)


@pytest.mark.parametrize("m", [1, 3, 8, 47, 48, 300])
def test_wna16_linear_dispatch(m):
    g = torch.Generator().manual_seed(m)
    qw, s, z = _weights(4096, 4096, 4, 128, False, "cuda", g)
    x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
    _close(wna16_linear(x, qw, s, z, 4), wna16_linear_torch(x, qw, s, z, 4), torch.bfloat16)


def test_wna16_under_cuda_graph():
    """Replayed from a CUDA graph (decode steps are) with new inputs copied in: split-K's zeroed
    buffer and the GEMM are recorded, so the replay equals an eager call on the new inputs."""
    g = torch.Generator().manual_seed(0)
    qw, s, z = _weights(4096, 4096, 4, 128, True, "cuda", g)
    for m in (1, 16, 32, 128):
        x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
        wna16_linear(x, qw, s, z, 4)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = wna16_linear(x, qw, s, z, 4)
        x.copy_(torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, wna16_linear_torch(x, qw, s, z, 4), torch.bfloat16)
