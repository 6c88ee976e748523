"""The LayerNorm (+ residual) and bias + GELU Triton kernels against their torch references on
random inputs (CUDA; skipped without it). tests/unit/test_ln_gelu_interpret.py runs the same
`check_*` functions on the CPU under Triton's interpreter."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.kernels.gelu import bias_gelu_torch
from pagedllm.kernels.layernorm import fused_add_layer_norm_torch, layer_norm_torch

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

# (atol, rtol) against the torch reference in the same dtype; the interpreter widens bf16's
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _close(actual, expected, what):
    atol, rtol = ELEMENTWISE_TOL[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _randn(*shape, dtype, device, gen, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)


def check_layer_norm(device, dtype, num_tokens, hidden, seed=0):
    from pagedllm.kernels.layernorm_triton import fused_add_layer_norm_triton, layer_norm_triton

    g = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=g, scale=2.0)
    res = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=g)
    # rows with a large mean: a one-pass E[x^2] - E[x]^2 variance would lose them (not summed
    # with a residual: the interpreter's bf16 rounding toward zero would be magnified 15x there)
    far = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=g, scale=2.0, shift=30.0)
    w = _randn(hidden, dtype=dtype, device=device, gen=g) + 1
    b = _randn(hidden, dtype=dtype, device=device, gen=g)
    x_before, res_before = x.clone(), res.clone()
    _close(layer_norm_triton(x, w, b, 1e-5), layer_norm_torch(x, w, b, 1e-5), "layer_norm")
    _close(layer_norm_triton(far, w, b, 1e-5), layer_norm_torch(far, w, b, 1e-5), "layer_norm, mean 30")
    _close(layer_norm_triton(x, w, None, 1e-6), layer_norm_torch(x, w, None, 1e-6), "layer_norm without bias")
    out, new_res = fused_add_layer_norm_triton(x, res, w, b, 1e-5)
    ref_out, ref_res = fused_add_layer_norm_torch(x, res, w, b, 1e-5)
    _close(new_res, ref_res, "fused_add residual")
    _close(out, ref_out, "fused_add_layer_norm")
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must not be written"
    wide = _randn(2, num_tokens, hidden + 8, dtype=dtype, device=device, gen=g)
    xs = wide[..., :hidden]  # a strided 3-D input
    _close(layer_norm_triton(xs, w, b, 1e-5), layer_norm_torch(xs, w, b, 1e-5), "layer_norm strided")


def check_bias_gelu(device, dtype, num_tokens, n, seed=0):
    from pagedllm.kernels.gelu_triton import bias_gelu_triton

    g = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, n, dtype=dtype, device=device, gen=g, scale=4.0)
    x[0, : min(n, 4)] = torch.tensor([-40.0, 40.0, 0.0, 1e-4][: min(n, 4)], dtype=dtype)  # tails and zero
    b = _randn(n, dtype=dtype, device=device, gen=g)
    before = x.clone()
    for approximate in ("none", "tanh"):
        _close(bias_gelu_triton(x, b, approximate), bias_gelu_torch(x, b, approximate), f"bias_gelu {approximate}")
        _close(bias_gelu_triton(x, None, approximate), bias_gelu_torch(x, None, approximate), f"gelu {approximate}")
    x3 = x.view(1, num_tokens, n)
    _close(bias_gelu_triton(x3, b, "tanh"), bias_gelu_torch(x3, b, "tanh"), "bias_gelu 3-D")
    assert torch.equal(x, before), "the input must not be written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 1000), (133, 2560), (64, 8192)])
def test_layer_norm(dtype, num_tokens, hidden):
    check_layer_norm("cuda", dtype, num_tokens, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,n", [(1, 64), (9, 1000), (200, 10240), (16, 24576)])
def test_bias_gelu(dtype, num_tokens, n):
    check_bias_gelu("cuda", dtype, num_tokens, n)


def test_dispatchers_use_triton_on_cuda():
    from pagedllm.kernels.gelu import bias_gelu
    from pagedllm.kernels.layernorm import fused_add_layer_norm, layer_norm

    g = torch.Generator().manual_seed(0)
    x = _randn(5, 256, dtype=torch.bfloat16, device="cuda", gen=g)
    r = _randn(5, 256, dtype=torch.bfloat16, device="cuda", gen=g)
    w = _randn(256, dtype=torch.bfloat16, device="cuda", gen=g)
    _close(layer_norm(x, w, r[0], 1e-5), layer_norm_torch(x, w, r[0], 1e-5), "layer_norm")
    _close(fused_add_layer_norm(x, r, w, None, 1e-5)[0], fused_add_layer_norm_torch(x, r, w, None, 1e-5)[0], "fused")
    _close(bias_gelu(x, w, "tanh"), bias_gelu_torch(x, w, "tanh"), "bias_gelu")
