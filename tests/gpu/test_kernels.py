"""Each Triton kernel against its torch reference on random inputs (CUDA; skipped without it).

The `check_*` functions take a device, so tests/unit/test_kernels_interpret.py reuses them on
the CPU at tiny shapes under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from pagedllm.attention.backend import ForwardBatch, key_major_view
from pagedllm.attention.torch_backend import TorchAttentionBackend, paged_attention_torch, store_kv_torch
from pagedllm.kernels.activation import silu_and_mul_torch
from pagedllm.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from pagedllm.kernels.rotary import apply_rotary_torch

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

# (atol, rtol) against the torch reference computed in the same dtype.
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}
ATTENTION_TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _close(actual, expected, tol, what=""):
    atol, rtol = tol[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def nan_past_the_end(t, dim):
    """t as a view of a buffer one row / column longer along dim, NaN there: a kernel that reads a
    scale group past the last turns its output NaN."""
    shape = list(t.shape)
    shape[dim] += 1
    view = torch.full(shape, float("nan"), dtype=t.dtype, device=t.device).narrow(dim, 0, t.shape[dim])
    view.copy_(t)
    return view


def _randn(*shape, dtype, device, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------- elementwise kernels


def check_rms_norm(device, dtype, num_tokens, hidden, seed=0):
    from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton

    g = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=g, scale=2.0)
    res = _randn(num_tokens, hidden, dtype=dtype, device=device, gen=g)
    w = _randn(hidden, dtype=dtype, device=device, gen=g) + 1
    x_before, res_before = x.clone(), res.clone()
    _close(rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), ELEMENTWISE_TOL, "rms_norm")
    out, new_res = fused_add_rms_norm_triton(x, res, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_torch(x, res, w, 1e-5)
    _close(new_res, ref_res, ELEMENTWISE_TOL, "fused_add residual")
    _close(out, ref_out, ELEMENTWISE_TOL, "fused_add_rms_norm")
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must not be written"
    # a strided 3-D input (a column slice of a wider tensor)
    wide = _randn(2, num_tokens, hidden + 8, dtype=dtype, device=device, gen=g)
    xs = wide[..., :hidden]
    _close(rms_norm_triton(xs, w, 1e-6), rms_norm_torch(xs, w, 1e-6), ELEMENTWISE_TOL, "rms_norm strided")
    # per-head norms of q heads sliced from a fused qkv row (Qwen3's q_norm): [T, H, D] whose
    # token and head strides do not flatten; read in place
    heads = 3
    qkv = _randn(num_tokens, (heads + 2) * hidden, dtype=dtype, device=device, gen=g, scale=2.0)
    q = qkv[:, : heads * hidden].view(num_tokens, heads, hidden)
    before = qkv.clone()
    out = rms_norm_triton(q, w, 1e-6)
    assert out.shape == q.shape
    _close(out, rms_norm_torch(q, w, 1e-6), ELEMENTWISE_TOL, "rms_norm of heads sliced from qkv")
    assert torch.equal(qkv, before)


def check_silu_and_mul(device, dtype, num_tokens, d, seed=0):
    from pagedllm.kernels.activation_triton import silu_and_mul_triton

    g = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, 2 * d, dtype=dtype, device=device, gen=g, scale=3.0)
    _close(silu_and_mul_triton(x), silu_and_mul_torch(x), ELEMENTWISE_TOL, "silu_and_mul")
    x3 = x.view(1, num_tokens, 2 * d)
    _close(silu_and_mul_triton(x3), silu_and_mul_torch(x3), ELEMENTWISE_TOL, "silu_and_mul 3-D")


def check_gelu_tanh_and_mul(device, dtype, num_tokens, d, seed=0):
    from pagedllm.kernels.activation import gelu_tanh_and_mul_torch
    from pagedllm.kernels.activation_triton import gelu_tanh_and_mul_triton

    g = torch.Generator().manual_seed(seed)
    x = _randn(num_tokens, 2 * d, dtype=dtype, device=device, gen=g, scale=3.0)
    x[0, :4] = torch.tensor([-30.0, -8.0, 8.0, 30.0])  # the tails of tanh
    _close(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_torch(x), ELEMENTWISE_TOL, "gelu_tanh_and_mul")


def _rope_cache(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def check_rotary(device, dtype, num_tokens, hq, hkv, head_dim, max_pos=4096, seed=0):
    from pagedllm.kernels.rotary_triton import apply_rotary_triton

    g = torch.Generator().manual_seed(seed)
    cos, sin = (c.to(device) for c in _rope_cache(max_pos, head_dim))
    pos = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    # q and k as views into one fused qkv projection, like the model produces them
    qkv = _randn(num_tokens, (hq + 2 * hkv) * head_dim, dtype=dtype, device=device, gen=g)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(num_tokens, hkv, head_dim)
    before = qkv.clone()
    q_out, k_out = apply_rotary_triton(pos, q, k, cos, sin)
    q_ref, k_ref = apply_rotary_torch(pos, q, k, cos, sin)
    _close(q_out, q_ref, ELEMENTWISE_TOL, "rotary q")
    _close(k_out, k_ref, ELEMENTWISE_TOL, "rotary k")
    assert torch.equal(qkv, before), "inputs must not be written"


# ------------------------------------------------------------------------- paged attention


def make_batch(query_lens, seq_lens, num_decodes, block_size, device, seed=0, pad_tokens=0):
    """A ForwardBatch over a shuffled block pool (block 0 left unused, as padding points to it).
    `pad_tokens` extra tokens at the end have slot -1 (they belong to no request)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(nblk + [1])
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots, positions = [], []
    for r, (ql, sl, nb) in enumerate(zip(query_lens, seq_lens, nblk)):
        block_tables[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        for p in range(sl - ql, sl):
            positions.append(p)
            slots.append(int(block_tables[r, p // block_size]) * block_size + p % block_size)
    slots += [-1] * pad_tokens
    positions += [0] * pad_tokens
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    t = len(slots)
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        logits_indices=torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return batch, num_blocks


def _attention_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed):
    g = torch.Generator().manual_seed(seed + 1)
    t = batch.num_tokens
    q = _randn(t, hq, head_dim, dtype=dtype, device=device, gen=g)
    k = _randn(t, hkv, head_dim, dtype=dtype, device=device, gen=g)
    v = _randn(t, hkv, head_dim, dtype=dtype, device=device, gen=g)
    # The cached prefix holds random K/V already (what earlier steps stored).
    k_cache = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device, gen=g)
    v_cache = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device, gen=g)
    return q, k, v, k_cache, v_cache


def check_store_kv(device, dtype, num_tokens, hkv, head_dim, block_size, seed=0, v_key_major=False):
    """v_key_major: the V cache's blocks stored [Hkv, D, bs] (attention/backend.py), where a NaN
    in V is stored as 0 and an infinity saturated (the kernels read whole V blocks)."""
    from pagedllm.kernels.attention import store_kv_triton

    g = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) * 2 + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1  # padding tokens are not stored
    slots = slots.to(device)
    kvh = _randn(num_tokens, 2 * hkv, head_dim, dtype=dtype, device=device, gen=g)
    k, v = kvh[:, :hkv], kvh[:, hkv:]  # strided views, like a split of the fused projection
    kc = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device, gen=g)
    vc = _randn(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device, gen=g)
    if v_key_major:
        vc = key_major_view(torch.empty_like(vc)).copy_(vc)
        first = int(torch.nonzero(slots >= 0)[0])
        kvh[first, hkv, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, slots)
    store_kv_torch(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "store_kv differs from the reference"
    if v_key_major:
        slot = int(slots[first])
        top = torch.finfo(dtype).max
        assert vc[slot // block_size, slot % block_size, 0, :3].tolist() == [0.0, top, -top]
        assert bool(vc.isfinite().all()), "a key-major V cache must hold finite values only"


def check_decode(device, dtype, seq_lens, hq, hkv, head_dim, block_size, num_splits=None, seed=0,
                 sliding_window=None, logits_soft_cap=None, order=None, last_reduce=False, calls=1, merge_unroll=None):
    """Decode kernel alone (num_splits None: the heuristic for the batch's max_seq_len), with a
    sliding window and a logit soft cap when given;
    order "desc" / "shuffled": the programs take the requests longest first / in a random order
    (the output must not change); last_reduce: the last split merges the splits (no reduce
    kernel): within float32 rounding of the reduce kernel's output, `calls` times in a row, each
    leaving the counters at zero."""
    opts = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    from pagedllm.kernels.attention_decode import decode_attention_triton

    b = len(seq_lens)
    batch, num_blocks = make_batch([1] * b, seq_lens, b, block_size, device, seed)
    q, _, _, k_cache, v_cache = _attention_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed)
    out = torch.empty_like(q)
    if order == "desc":
        order = torch.argsort(batch.seq_lens, descending=True).to(torch.int32)
    elif order == "shuffled":
        order = torch.randperm(b, generator=torch.Generator().manual_seed(seed)).to(torch.int32).to(device)
    for call in range(calls):
        if call:
            q = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + call)).to(q)
        decode_attention_triton(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens, out, head_dim**-0.5,
            max_seq_len=batch.max_seq_len, num_splits=num_splits, order=order, last_reduce=last_reduce,
            merge_unroll=merge_unroll, **opts,
        )  # fmt: skip
        ref = paged_attention_torch(q, k_cache, v_cache, batch, head_dim**-0.5, **opts)
        _close(out, ref, ATTENTION_TOL, f"decode splits={num_splits} order={order is not None} {opts}")
        if last_reduce:
            from pagedllm.kernels.counters import counters

            assert int(counters(torch.device(device), 1).count_nonzero()) == 0, f"call {call} left counters set"
            merged = torch.empty_like(out)
            decode_attention_triton(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, merged, head_dim**-0.5,
                max_seq_len=batch.max_seq_len, num_splits=num_splits, order=order, last_reduce=False, **opts,
            )  # fmt: skip
            # the same merge in another summation order: float32 rounding, or an ulp of a 16-bit output
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out.dtype]
            torch.testing.assert_close(out.float(), merged.float(), atol=tol, rtol=tol)


def check_prefill(device, dtype, query_lens, seq_lens, hq, hkv, head_dim, block_size, config=None, seed=0,
                  sliding_window=None, logits_soft_cap=None):
    """Prefill kernel alone over requests with cached prefixes of seq_len - query_len tokens."""
    opts = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    from pagedllm.kernels.attention import prefill_attention_triton

    batch, num_blocks = make_batch(query_lens, seq_lens, 0, block_size, device, seed)
    q, _, _, k_cache, v_cache = _attention_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed)
    out = torch.full_like(q, float("nan"))
    prefill_attention_triton(
        q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, out, head_dim**-0.5,
        first_req=0, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len, config=config, **opts,
    )  # fmt: skip
    ref = paged_attention_torch(q, k_cache, v_cache, batch, head_dim**-0.5, **opts)
    _close(out, ref, ATTENTION_TOL, f"prefill {opts}")


def check_backend(device, dtype, query_lens, seq_lens, num_decodes, hq, hkv, head_dim, block_size, seed=0, pad_tokens=0,
                  backend=None, sliding_window=None, logits_soft_cap=None, order_decodes=False, v_key_major=False):
    """The whole backend (store + decode + prefill; default Triton) against TorchAttentionBackend;
    order_decodes: the Triton backend's step metadata orders the decodes longest first;
    v_key_major: V blocks stored [Hkv, D, bs] (FP8's layout, PAGEDLLM_V_TRANSPOSED for 16 bits)."""
    if backend is None:
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
        backend.order_decodes = order_decodes
    batch, num_blocks = make_batch(query_lens, seq_lens, num_decodes, block_size, device, seed, pad_tokens)
    batch.attn_metadata = backend.build_metadata(batch, block_size)
    if order_decodes:
        assert batch.attn_metadata is not None or num_decodes < 2, "no decode order was built"
    q, k, v, k_cache, v_cache = _attention_inputs(batch, num_blocks, block_size, hq, hkv, head_dim, dtype, device, seed)
    if v_key_major:
        v_cache = key_major_view(torch.empty_like(v_cache)).copy_(v_cache)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    opts = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    out = backend.forward(q, k, v, k_cache, v_cache, batch, head_dim**-0.5, **opts)
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, batch, head_dim**-0.5, **opts)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref), "caches differ"
    n = batch.num_tokens - pad_tokens
    _close(out[:n], ref[:n], ATTENTION_TOL, "backend")


# ------------------------------------------------------------------------------ GPU tests


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 1000), (133, 4096), (64, 8192)])
def test_rms_norm(dtype, num_tokens, hidden):
    check_rms_norm("cuda", dtype, num_tokens, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (9, 1000), (200, 3072), (16, 14336)])
def test_silu_and_mul(dtype, num_tokens, d):
    check_silu_and_mul("cuda", dtype, num_tokens, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim", [(1, 4, 1, 64), (37, 16, 16, 128), (300, 32, 8, 128), (5, 14, 2, 64)])
def test_rotary(dtype, num_tokens, hq, hkv, head_dim):
    check_rotary("cuda", dtype, num_tokens, hq, hkv, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens,hkv,head_dim", [(1, 1, 64), (100, 8, 128), (333, 3, 80)])
def test_store_kv(dtype, block_size, num_tokens, hkv, head_dim):
    check_store_kv("cuda", dtype, num_tokens, hkv, head_dim, block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv,head_dim", [(8, 8, 64), (32, 8, 128), (14, 2, 64), (16, 1, 128)])
def test_decode(dtype, block_size, hq, hkv, head_dim):
    seq_lens = [1, 17, 250, 64, 1000, 33]
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, block_size, num_splits=1)
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, block_size, num_splits=5)
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, block_size)
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, block_size, num_splits=1, order="desc")
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, block_size, num_splits=3, order="shuffled")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)])
def test_decode_long_context_split_k(dtype, block_size, hq, hkv):
    from pagedllm.kernels.attention_decode import decode_num_splits

    seq_lens = [16384, 3000, 9001]
    assert decode_num_splits(len(seq_lens), hkv, max(seq_lens), 132) > 1
    check_decode("cuda", dtype, seq_lens, hq, hkv, 128, block_size)  # the heuristic's split count
    check_decode("cuda", dtype, seq_lens, hq, hkv, 128, block_size, num_splits=32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv,head_dim", [(8, 8, 64), (32, 8, 128), (14, 2, 64), (12, 4, 80)])
def test_prefill_fresh_prompts(dtype, block_size, hq, hkv, head_dim):
    lens = [1, 17, 200, 513, 64]
    check_prefill("cuda", dtype, lens, lens, hq, hkv, head_dim, block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8)])
def test_prefill_cached_prefix_chunks(dtype, block_size, hq, hkv):
    # (query_len, seq_len): chunks after a cached prefix, prefix-cache hits, one-token chunks
    pairs = [(100, 612), (1, 50), (256, 256), (37, 1037), (130, 4226), (16, 32)]
    check_prefill("cuda", dtype, [p[0] for p in pairs], [p[1] for p in pairs], hq, hkv, 128, block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv,head_dim", [(32, 8, 128), (16, 16, 64)])
def test_backend_mixed_batch(dtype, block_size, hq, hkv, head_dim):
    # 4 decodes (one with a long context), then a fresh prompt and two chunks over cached prefixes
    query_lens = [1, 1, 1, 1, 300, 64, 7]
    seq_lens = [5, 129, 4000, 48, 300, 1064, 519]
    check_backend("cuda", dtype, query_lens, seq_lens, 4, hq, hkv, head_dim, block_size, pad_tokens=3)
    check_backend("cuda", dtype, query_lens, seq_lens, 4, hq, hkv, head_dim, block_size, pad_tokens=3,
                  order_decodes=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_backend_v_key_major(dtype, block_size):
    """V blocks stored key-major (FP8's layout; PAGEDLLM_V_TRANSPOSED=1 for 16-bit caches): the
    whole backend against the torch backend, with and without a sliding window (one starting
    inside a block)."""
    query_lens = [1, 1, 1, 1, 300, 64, 7]
    seq_lens = [5, 129, 4000, 48, 300, 1064, 519]
    check_backend("cuda", dtype, query_lens, seq_lens, 4, 32, 8, 128, block_size, pad_tokens=3, v_key_major=True)
    check_backend("cuda", dtype, query_lens, seq_lens, 4, 32, 8, 128, block_size, v_key_major=True,
                  sliding_window=1001, logits_soft_cap=30.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_backend_only_decodes_and_only_prefills(dtype):
    check_backend("cuda", dtype, [1] * 9, [3, 70, 900, 1, 16, 17, 2047, 5000, 31], 9, 32, 8, 128, 16)
    check_backend("cuda", dtype, [5, 900, 1], [5, 1000, 1], 0, 32, 8, 128, 16)


def test_dispatchers_use_triton_on_cuda():
    from pagedllm.kernels.activation import silu_and_mul
    from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm
    from pagedllm.kernels.rotary import apply_rotary

    g = torch.Generator().manual_seed(0)
    x = _randn(5, 256, dtype=torch.bfloat16, device="cuda", gen=g)
    r = _randn(5, 256, dtype=torch.bfloat16, device="cuda", gen=g)
    w = _randn(256, dtype=torch.bfloat16, device="cuda", gen=g)
    _close(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), ELEMENTWISE_TOL)
    _close(fused_add_rms_norm(x, r, w, 1e-6)[0], fused_add_rms_norm_torch(x, r, w, 1e-6)[0], ELEMENTWISE_TOL)
    _close(silu_and_mul(x), silu_and_mul_torch(x), ELEMENTWISE_TOL)
    cos, sin = (c.cuda() for c in _rope_cache(64, 32))
    pos = torch.arange(5, device="cuda")
    q, k = x.view(5, 8, 32), r.view(5, 8, 32)
    for a, b in zip(apply_rotary(pos, q, k, cos, sin), apply_rotary_torch(pos, q, k, cos, sin)):
        _close(a, b, ELEMENTWISE_TOL)


def test_decode_under_cuda_graph():
    """A captured decode step replays correctly after the sequence lengths and block tables
    change in place (the grid depends only on the batch size and the max_seq_len bound)."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    dtype, hq, hkv, d, bs = torch.bfloat16, 32, 8, 128, 16
    seq_lens = [10, 700, 3000, 45]
    batch, num_blocks = make_batch([1] * 4, seq_lens, 4, bs, "cuda", seed=3)
    batch.max_seq_len = 8192  # the bound the runner would capture with
    q, k, v, k_cache, v_cache = _attention_inputs(batch, num_blocks + 600, bs, hq, hkv, d, dtype, "cuda", 3)
    backend = TritonAttentionBackend()
    scale = d**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, k_cache, v_cache, batch, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, batch, scale)
    # next step: every sequence one token longer, new inputs written into the captured buffers
    new_lens = [s + 1 for s in seq_lens]
    nxt, _ = make_batch([1] * 4, new_lens, 4, bs, "cuda", seed=4)
    batch.seq_lens.copy_(nxt.seq_lens)
    batch.block_tables.zero_()
    batch.block_tables[:, : nxt.block_tables.shape[1]].copy_(nxt.block_tables)
    batch.slot_mapping.copy_(nxt.slot_mapping)
    g = torch.Generator().manual_seed(9)
    for t in (q, k, v):
        t.copy_(_randn(*t.shape, dtype=dtype, device="cuda", gen=g))
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    graph.replay()
    ref = TorchAttentionBackend().forward(q, k, v, kc_ref, vc_ref, nxt, scale)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, kc_ref)
    _close(out, ref, ATTENTION_TOL, "graph replay")
