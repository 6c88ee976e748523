"""The CPU attention backend (decodes through the C kernel of pagedllm/kernels/cpu_kernels.py)
against the torch reference backend, on the batches the GPU kernels are checked with: mixed
decodes and prefill chunks over cached prefixes, GQA/MQA, several block sizes, padding slots."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedllm.attention.registry import get_attention_backend
from pagedllm.kernels import cpu_kernels

_spec = importlib.util.spec_from_file_location(
    "gpu_kernel_checks", Path(__file__).resolve().parents[1] / "gpu" / "test_kernels.py")
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU attention kernel could not be built")


@pytest.mark.parametrize("case", [
    # query_lens, seq_lens, num_decodes, hq, hkv, head_dim, block_size
    ([1], [1], 1, 4, 4, 64, 16),  # the first token: a one-token context
    ([1] * 5, [3, 16, 17, 40, 129], 5, 8, 2, 64, 16),  # block edges, GQA
    ([1] * 4, [5, 33, 64, 200], 4, 6, 1, 32, 8),  # MQA, small blocks
    ([1] * 3 + [7, 20], [9, 100, 31, 7, 52], 3, 4, 2, 128, 16),  # decodes + prefills over a prefix
    ([1] * 2 + [5], [300, 2, 5], 2, 12, 4, 64, 32),  # long context, block size 32
])
def test_cpu_backend_equals_torch_reference(case):
    from pagedllm.attention.cpu_backend import CpuAttentionBackend

    query_lens, seq_lens, nd, hq, hkv, d, bs = case
    checks.check_backend("cpu", torch.float32, query_lens, seq_lens, nd, hq, hkv, d, bs, seed=len(seq_lens),
                         backend=CpuAttentionBackend())


def test_cpu_backend_with_padding_slots():
    from pagedllm.attention.cpu_backend import CpuAttentionBackend

    checks.check_backend("cpu", torch.float32, [1, 1, 1], [20, 7, 64], 3, 4, 2, 64, 16, pad_tokens=2,
                         backend=CpuAttentionBackend())


def test_cpu_backend_leaves_other_dtypes_to_torch():
    from pagedllm.attention.cpu_backend import CpuAttentionBackend

    checks.check_backend("cpu", torch.bfloat16, [1, 1, 4], [20, 7, 9], 2, 4, 2, 64, 16,
                         backend=CpuAttentionBackend())


def test_kernel_reads_a_strided_query_in_place():
    """q as the rotary step leaves it: a view into [T, Hq + Hkv, D] with a row stride."""
    batch, num_blocks = checks.make_batch([1] * 4, [10, 30, 17, 50], 4, 16, "cpu", seed=3)
    g = torch.Generator().manual_seed(0)
    qk = torch.randn(4, 8 + 2, 64, generator=g)
    q = qk[:, :8]
    kc = torch.randn(num_blocks, 16, 2, 64, generator=g)
    vc = torch.randn(num_blocks, 16, 2, 64, generator=g)
    assert cpu_kernels.supports(q, kc) and not q.is_contiguous()
    out = cpu_kernels.paged_decode_attention(q, kc, vc, batch.block_tables, batch.seq_lens, 0.125)
    from pagedllm.attention.torch_backend import paged_attention_torch

    ref = paged_attention_torch(q.contiguous(), kc, vc, batch, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_default_backend_on_cpu(monkeypatch):
    assert get_attention_backend(None, "cpu").name == "cpu"
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert get_attention_backend(None, "cpu").name == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        get_attention_backend("cpu", "cpu")


@pytest.mark.parametrize("cols", [1, 7, 16, 49152])
def test_argmax_equals_torch(cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(33, cols, generator=g)
    x[3] = 0.5  # a row of ties: the first index wins
    if cols > 5:
        x[4, 5] = float("nan")  # NaN wins, as in torch
        x[5, 2] = x[5, cols - 1] = 1e9  # two equal maxima
        x[6] = float("-inf")
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))
    view = torch.randn(8, cols + 3, generator=g)[:, 1 : cols + 1]  # a row stride
    assert torch.equal(cpu_kernels.argmax(view), view.argmax(dim=-1))
    assert cpu_kernels.argmax(torch.randn(0, cols)).shape == (0,)


def test_rms_norm_matches_torch_reference():
    from pagedllm.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch

    g = torch.Generator().manual_seed(0)
    for rows, h in [(1, 64), (7, 576), (300, 96)]:
        x = torch.randn(rows, h, generator=g) * 3
        r = torch.randn(rows, h + 8, generator=g)[:, :h]  # a row stride
        w = torch.randn(h, generator=g)
        torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), rtol=2e-6, atol=2e-6)
        out, total = cpu_kernels.rms_norm(x, w, 1e-5, residual=r)
        ref_out, ref_total = fused_add_rms_norm_torch(x, r, w, 1e-5)
        assert torch.equal(total, ref_total)
        torch.testing.assert_close(out, ref_out, rtol=2e-6, atol=2e-6)
    assert cpu_kernels.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6) is None  # left to torch
    assert cpu_kernels.rms_norm(x.view(10, 30, 96), w, 1e-6) is None


def test_rotary_is_bit_identical_to_torch_path():
    from pagedllm.kernels.rotary import apply_rotary_torch
    from pagedllm.model.layers.rotary import get_rotary_embedding

    rope = get_rotary_embedding(64, 1024, {"rope_theta": 10000.0, "rope_type": "default"})
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(37, (9 + 3 + 3) * 64, generator=g)
    q = qkv[:, : 9 * 64].view(37, 9, 64)  # views into the fused projection, as in the model
    k = qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)
    pos = torch.randint(0, 1024, (37,), generator=g)
    got = cpu_kernels.rotary(pos, q, k, rope.cos_cache, rope.sin_cache)
    ref = apply_rotary_torch(pos, q, k, rope.cos_cache, rope.sin_cache)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert cpu_kernels.rotary(pos, q.double(), k.double(), rope.cos_cache, rope.sin_cache) is None
