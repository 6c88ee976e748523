"""The GGUF CPU kernels (pagedllm/kernels/csrc/gguf_kernels.c) against the `gguf` package's
dequantize on random blocks of every supported type: the dequantized rows, embedding-style row
lookups, and the product (decode-sized and prefill-sized row counts, odd N, a strided output)
against dequantize-then-matmul; the int8-activation product (Q4_0, Q4_1, Q8_0) against
dequantize-then-matmul of the same quantized activations (to float32 rounding) and against the
float32 activations within the bound the activation rounding explains. Every build of the C
file's #if branches is checked: the default (-march=native: AVX512-VNNI here), AVX2 with
AVX-VNNI, plain AVX2 (VPMADDUBSW) and scalar C (-mno-avx2 ...)."""

import numpy as np
import pytest
import torch

from pagedllm.kernels import cpu_kernels, gguf_kernels

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


_BUILDS = {"default": (), "avx2-vnni": gguf_kernels.AVX2_VNNI_FLAGS, "avx2": gguf_kernels.AVX2_FLAGS,
           "scalar": gguf_kernels.SCALAR_FLAGS}


@pytest.fixture(scope="module", params=list(_BUILDS))
def kern(request):
    if request.param == "avx2-vnni" and not cpu_kernels.cpu_has(gguf_kernels.AVX2_VNNI_CPU_FLAG):
        pytest.skip("this CPU has no AVX-VNNI: the build's VPDPBUSD would be an illegal instruction")
    return gguf_kernels.kernels() if request.param == "default" else gguf_kernels.GGUFKernels(_BUILDS[request.param])


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
    y = kern.matmul(x, w, qtype, k, int8=False)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=2e-3)  # float32 sums of 768 products ~1
    # into a column slice of a wider output, from non-contiguous activations
    wide = torch.full((m, n + 5), 7.0)
    xt = x.t().contiguous().t()
    kern.matmul(xt, w, qtype, k, out=wide[:, 2:2 + n], int8=False)
    torch.testing.assert_close(wide[:, 2:2 + n], ref, rtol=1e-4, atol=2e-3)
    assert (wide[:, :2] == 7.0).all() and (wide[:, 2 + n:] == 7.0).all()


def _quantize_reference(x: torch.Tensor):
    """Q8_0-style blocks of 32 in torch: d = max|x| / 127, codes round-half-even(x * (1 / d))."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(dim=2) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(m, k), d, d * q.to(torch.int32).sum(dim=2).float()


def _activations(q, r, d):
    """What the kernel's codes stand for, float64 [M, K]."""
    m, k = q.shape
    codes = q.double() if r is None else 254 * q.double() + r.double()
    return (codes.reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k)


def test_quantize_activations(kern):
    x = torch.randn(5, 224, generator=torch.Generator().manual_seed(1)) * 3
    x[1, 32:64] = 0.0  # a zero block: scale 0, codes 0
    x[2, :32] = torch.linspace(-1, 1, 32)  # max|x| exactly +-1: codes +-127
    q, r, d, s = kern.quantize_activations(x)
    rq, rd, rs = _quantize_reference(x)
    assert r is None and torch.equal(q, rq) and torch.equal(d, rd)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert (q[1, 32:64] == 0).all() and d[1, 1] == 0 and q[2, 0] == -127 and q[2, 31] == 127
    # two passes: the same first codes, the residual's codes at 254 times finer a scale
    q2, r2, d2, s2 = kern.quantize_activations(x, passes=2)
    assert torch.equal(q2, q) and r2.abs().max() <= 127 and r2.abs().max() > 100
    torch.testing.assert_close(d2, d / 254, rtol=1e-7, atol=0)
    err = (_activations(q2, r2, d2) - x.double()).abs().reshape(5, -1, 32).amax(dim=2)
    assert (err <= d2.double() * 0.5001 + 1e-12).all()  # half the fine scale: ~1/254 of one pass's error
    torch.testing.assert_close(s2.double(), _activations(q2, r2, d2).reshape(5, -1, 32).sum(dim=2), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("qtype", sorted(gguf_kernels.INT8_TYPES))
@pytest.mark.parametrize("m", [1, 3, 8, 32, 65, 130])  # 130: past a 128-row work item
@pytest.mark.parametrize("n,k", [(37, 96), (64, 576), (19, 1536)])  # K not a multiple of 256; N not of 8 / 16
@pytest.mark.parametrize("passes", [1, 2])
def test_int8_matmul(kern, qtype, m, n, k, passes):
    w = random_blocks(qtype, n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2
    x[0, :32] = 0.0  # a zero block of activations
    wd = gguf_kernels.dequantize_reference(w, qtype, k).double()
    q, r, d, _ = kern.quantize_activations(x, passes)
    ref = _activations(q, r, d) @ wd.T  # dequantize-then-matmul of the same int8 activations
    y = kern.matmul(x, w, qtype, k, int8=passes)
    # float32 rounding only: the integer sums are exact, each block's scaling is one float op
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # against float32 activations: each activation is off by at most half its block's (finest) scale
    bound = wd.abs() @ (d.double() / 2).repeat_interleave(32, dim=1).T  # [n, m]
    exact = x.double() @ wd.T
    err = (y.double() - exact).abs()
    assert (err <= bound.T * (1 + 1e-4) + 1e-5 * exact.abs().max().item()).all(), (err - bound.T).max()
    if passes == 1:
        assert err.max() > 1e-4 * exact.abs().max()  # (the activations were quantized: not the float path)
    # into a column slice of a wider output, from non-contiguous activations
    wide = torch.full((m, n + 3), 7.0)
    kern.matmul(x.t().contiguous().t(), w, qtype, k, out=wide[:, 1:1 + n], int8=passes)
    torch.testing.assert_close(wide[:, 1:1 + n], y, rtol=0, atol=0)
    assert (wide[:, :1] == 7.0).all() and (wide[:, 1 + n:] == 7.0).all()


def test_int8_is_refused_for_k_quants():
    kern = gguf_kernels.kernels()
    w = random_blocks("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="int8: no int8-activation product for Q4_K"):
        kern.matmul(torch.zeros(1, 256), w, "Q4_K", 256, int8=2)
    with pytest.raises(ValueError, match="int8 must be 0, 1 or 2"):
        kern.matmul(torch.zeros(1, 256), w, "Q4_K", 256, int8=3)
    x = torch.randn(2, 256)  # the default for a K-quant is the float path
    torch.testing.assert_close(kern.matmul(x, w, "Q4_K", 256), kern.matmul(x, w, "Q4_K", 256, int8=False),
                               rtol=0, atol=0)


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
    with pytest.raises(ValueError, match="x must be float32"):
        kern.quantize_activations(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        kern.quantize_activations(torch.zeros(2, 64), passes=3)


def test_default_mode():
    """The default product of a Q4_1 weight is the two-pass int8 one (PAGEDLLM_GGUF_INT8 unset)."""
    kern = gguf_kernels.kernels()
    w = random_blocks("Q4_1", 40, 576)
    x = torch.randn(8, 576)
    expected = gguf_kernels.int8_mode()
    assert torch.equal(kern.matmul(x, w, "Q4_1", 576), kern.matmul(x, w, "Q4_1", 576, int8=expected))
    if expected:
        assert not torch.equal(kern.matmul(x, w, "Q4_1", 576), kern.matmul(x, w, "Q4_1", 576, int8=0))
