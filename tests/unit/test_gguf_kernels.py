"""The GGUF CPU kernels (pagedllm/kernels/csrc/gguf_kernels.c) against the `gguf` package's
dequantize on random blocks of every supported type: the dequantized rows, embedding-style row
lookups, and the product (decode-sized and prefill-sized row counts, odd N, a strided output)
against dequantize-then-matmul. Both the default build (AVX2 / AVX-512 here) and a scalar
build (-mno-avx2 ...) are checked."""

import numpy as np
import pytest
import torch

from pagedllm.kernels import gguf_kernels

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="no C compiler for the GGUF kernels")

# byte offsets of each type's float16 fields in a block (scale d, and min / dmin where there is one)
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of k columns of random GGUF blocks: random bits, with sane float16 scales."""
    _, block, size = gguf_kernels.QUANT_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scale = (rng.standard_normal((n, k // block)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1).copy())


@pytest.fixture(scope="module", params=["default", "scalar"])
def kern(request):
    return gguf_kernels.kernels() if request.param == "default" else gguf_kernels.GGUFKernels(gguf_kernels.SCALAR_FLAGS)


@pytest.mark.parametrize("qtype", list(gguf_kernels.QUANT_TYPES))
def test_dequantize_matches_gguf(kern, qtype):
    k = 512
    w = random_blocks(qtype, 7, k)
    ref = gguf_kernels.dequantize_reference(w, qtype, k)
    torch.testing.assert_close(kern.dequantize(w, qtype, k), ref, rtol=0, atol=0)
    ids = torch.tensor([[6, 0], [3, 3]])
    torch.testing.assert_close(kern.dequantize(w, qtype, k, ids), ref[ids], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", list(gguf_kernels.QUANT_TYPES))
@pytest.mark.parametrize("m", [1, 3, 8, 70])
def test_matmul_matches_dequantize_then_matmul(kern, qtype, m):
    k, n = 768, 37  # 37: a partial block of weight rows
    w = random_blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = (x.double() @ gguf_kernels.dequantize_reference(w, qtype, k).double().T).float()
    torch.testing.assert_close(kern.matmul(x, w, qtype, k), ref, rtol=1e-4, atol=2e-3)  # float32 sums of 768 products ~1
    # into a column slice of a wider output, from non-contiguous activations
    wide = torch.full((m, n + 5), 7.0)
    xt = x.t().contiguous().t()
    kern.matmul(xt, w, qtype, k, out=wide[:, 2:2 + n])
    torch.testing.assert_close(wide[:, 2:2 + n], ref, rtol=1e-4, atol=2e-3)
    assert (wide[:, :2] == 7.0).all() and (wide[:, 2 + n:] == 7.0).all()


def test_bad_inputs_are_refused():
    kern = gguf_kernels.kernels()
    w = random_blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="Q5_0"):
        kern.matmul(torch.zeros(1, 64), w, "Q5_0", 64)
    with pytest.raises(ValueError, match="not whole Q4_1 blocks"):
        kern.matmul(torch.zeros(1, 48), w, "Q4_1", 48)
    with pytest.raises(ValueError, match="activations must be float32"):
        kern.matmul(torch.zeros(1, 64, dtype=torch.float64), w, "Q4_1", 64)
    with pytest.raises(ValueError, match="out must be"):
        kern.matmul(torch.zeros(2, 64), w, "Q4_1", 64, out=torch.empty(2, 3))
