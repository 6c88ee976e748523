"""MKL-packed projection weights (pagedllm/kernels/cpu_gemm.py) against F.linear (the loader's
use of them: tests/models/test_cpu_weights.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_gemm

needs_mkl = pytest.mark.skipif(not cpu_gemm.available(), reason="torch is not linked with MKL")


@needs_mkl
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17, 32, 48, 100])
def test_packed_equals_linear(layout, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    if layout == "column-major":
        w = w.t().contiguous().t()
    bias = torch.randn(200, generator=g)
    x = torch.randn(rows, 96, generator=g)
    packed = cpu_gemm.PackedWeight(w)
    torch.testing.assert_close(packed.linear(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous input (a view with a row stride) gives the same
    wide = torch.randn(rows, 192, generator=g)
    torch.testing.assert_close(packed.linear(wide[:, ::2]), F.linear(wide[:, ::2], w), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_copy_is_independent_of_the_weight():
    w = torch.randn(64, 32)
    x = torch.randn(4, 32)
    packed = cpu_gemm.PackedWeight(w)
    expected = F.linear(x, w)
    w.zero_()  # the packed copy was made at construction
    torch.testing.assert_close(packed.linear(x), expected)


def test_packed_weight_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.PackedWeight(torch.randn(8, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        cpu_gemm.PackedWeight(torch.randn(8))


@needs_mkl
def test_linear_uses_the_packed_weight_only_for_small_products():
    w = torch.randn(16, 8)
    packed = cpu_gemm.PackedWeight(w)
    packed_sentinel = cpu_gemm.PackedWeight(torch.zeros(16, 8))  # computes zeros
    small = torch.randn(cpu_gemm.MAX_PACKED_ROWS, 8)
    large = torch.randn(cpu_gemm.MAX_PACKED_ROWS + 1, 8)
    assert torch.count_nonzero(cpu_gemm.linear(small, w, None, packed_sentinel)) == 0
    torch.testing.assert_close(cpu_gemm.linear(large, w, None, packed_sentinel), F.linear(large, w))
    torch.testing.assert_close(cpu_gemm.linear(small, w, None, packed), F.linear(small, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_gemm.linear(small, w, None, None), F.linear(small, w))
