"""The few-rows linear kernel (pagedllm/kernels/few_rows_triton.py) against its torch reference:
1-16 rows, shapes off the tiles, bias, float32 output (the MoE router), bad shapes (CUDA;
tests/unit/test_few_rows_interpret.py runs the same checks on the CPU under the interpreter)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def check_few_rows(device, dtype, rows, n, k, bias=False, out_float32=False, config=None, seed=0):
    from pagedllm.kernels.few_rows import few_rows_linear_torch
    from pagedllm.kernels.few_rows_triton import few_rows_linear_triton

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    out_dtype = torch.float32 if out_float32 else None
    ref = few_rows_linear_torch(x, w, b, out_dtype)
    got = few_rows_linear_triton(x, w, b, out_dtype, config)
    assert got.dtype == ref.dtype and got.shape == (rows, n)
    atol, rtol = TOL[torch.float32 if out_float32 and dtype == torch.float32 else dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", [(5120, 2048), (2048, 4096), (300, 200), (128, 2048)])
def test_few_rows(dtype, rows, shape):
    check_few_rows("cuda", dtype, rows, *shape)


def test_bias_and_float32_output():
    check_few_rows("cuda", torch.bfloat16, 3, 640, 512, bias=True)
    check_few_rows("cuda", torch.bfloat16, 1, 128, 2048, out_float32=True)


@pytest.mark.parametrize("config", [(16, 512, 4, 3), (64, 128, 4, 4), (32, 256, 8, 4), (8, 512, 4, 4)])
def test_tiles(config):
    check_few_rows("cuda", torch.bfloat16, 1, 5120, 2048, config=config)
    check_few_rows("cuda", torch.bfloat16, 4, 2048, 4096, config=config)


def test_linear_layers_take_it_when_switched_on(monkeypatch):
    """PAGEDLLM_FEW_ROWS_GEMV read when the layers are built: few rows go to the kernel, more to
    cuBLAS, both equal to F.linear."""
    from pagedllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear

    monkeypatch.setenv("PAGEDLLM_FEW_ROWS_GEMV", "4")
    col, row = ColumnParallelLinear(256, 512).cuda().bfloat16(), RowParallelLinear(512, 256).cuda().bfloat16()
    assert col.few_rows == row.few_rows == 4
    for layer in (col, row):
        layer.weight.data.normal_(0, 0.05)
        for rows in (1, 4, 9):
            x = torch.randn(rows, layer.weight.shape[1], device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, layer.weight)
            torch.testing.assert_close(layer(x).float(), ref.float(), atol=2e-2, rtol=2e-2)
