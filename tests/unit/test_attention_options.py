"""Per-layer attention options — a sliding window and a logit soft cap — in the CPU backend's C
decode kernel and the torch reference: the reference against attention written out densely
(one request, every query position), then the C kernel against the reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pagedllm.attention.torch_backend import paged_attention_torch
from pagedllm.kernels import cpu_kernels

_spec = importlib.util.spec_from_file_location(
    "gpu_kernel_checks", Path(__file__).resolve().parents[1] / "gpu" / "test_kernels.py")
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


def _dense(q, k, v, scale, window, cap):
    # q [L, Hq, D], k/v [L, Hkv, D]: every position attends causally (within the window)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    pos = torch.arange(q.shape[0])
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= pos[None, :] > pos[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0), (16, 1.5), (100, None)])
def test_reference_prefill_and_decode_equal_dense_attention(window, cap):
    """A 40-token prompt prefilled in chunks of 13 over its cached prefix, then decoded one
    token at a time, gives the dense masked attention of every position."""
    length, hq, hkv, d, bs = 40, 4, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(length, hq, d, generator=g)
    k = torch.randn(length, hkv, d, generator=g)
    v = torch.randn(length, hkv, d, generator=g)
    ref = _dense(q, k, v, 0.3, window, cap)
    for start, stop in [(0, 13), (13, 26), (26, 39), (39, 40)]:
        batch, num_blocks = checks.make_batch([stop - start], [stop], 1 if stop - start == 1 else 0, bs, "cpu")
        kc = torch.zeros(num_blocks, bs, hkv, d)
        vc = torch.zeros(num_blocks, bs, hkv, d)
        bt = batch.block_tables[0].long()
        for p in range(stop):  # the whole context so far is in the cache
            kc[bt[p // bs], p % bs] = k[p]
            vc[bt[p // bs], p % bs] = v[p]
        out = paged_attention_torch(q[start:stop], kc, vc, batch, 0.3, sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(out, ref[start:stop], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU attention kernel could not be built")
@pytest.mark.parametrize("window,cap", [(1, None), (7, None), (16, None), (33, 2.0), (None, 5.0), (1000, None)])
def test_cpu_backend_window_and_soft_cap(window, cap):
    """Decodes through the C kernel (windows inside one block, on block edges, longer than the
    context), prefill chunks through the reference, against TorchAttentionBackend."""
    from pagedllm.attention.cpu_backend import CpuAttentionBackend

    checks.check_backend("cpu", torch.float32, [1, 1, 1, 1, 9, 20], [3, 17, 64, 130, 9, 52], 4, 8, 2, 64, 16,
                         backend=CpuAttentionBackend(), sliding_window=window, logits_soft_cap=cap)
    # the C kernel itself was used: its decode rows equal the reference's
    assert CpuAttentionBackend().decode_kernel(torch.zeros(1, 8, 64), torch.zeros(1, 16, 2, 64), window, cap) is not None
