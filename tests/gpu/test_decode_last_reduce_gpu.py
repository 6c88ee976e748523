"""The decode kernel's splits merged by the last split of each (request, kv head)
(PAGEDLLM_DECODE_LAST_REDUCE, kernels/attention_decode.py) on the GPU: within float32 rounding of
the reduce kernel's output, counters back at zero after each call and each CUDA-graph replay.
Under the interpreter: tests/unit/test_kernels_interpret.py's decode_last_reduce cases."""

from __future__ import annotations

import pytest
import torch
from test_kernels import DTYPES, HAS_CUDA, _attention_inputs, _randn, check_decode, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim", [(32, 8, 128), (32, 4, 128), (14, 2, 64)])
def test_decode_last_reduce(dtype, hq, hkv, head_dim):
    """The last split merges the splits (PAGEDLLM_DECODE_LAST_REDUCE): batch 1 and 4 at 128-4096
    tokens of context (Llama-3.1-8B's and Qwen3-30B-A3B's heads), a 1-token context (empty
    splits), the longest-first order, a sliding window; twice in a row each."""
    for seq_lens in ([4096], [128], [128, 4096, 700, 1]):
        check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, 16, last_reduce=True, calls=2)
    seq_lens = [1, 17, 250, 64, 1000, 33]
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, 16, num_splits=5, order="desc", last_reduce=True)
    check_decode("cuda", dtype, seq_lens, hq, hkv, head_dim, 16, num_splits=3, sliding_window=100,
                 last_reduce=True)  # fmt: skip
    check_decode("cuda", dtype, [16384, 3000], hq, hkv, head_dim, 16, num_splits=64, last_reduce=True, calls=2)


@pytest.mark.parametrize("ordered", [False, True])
def test_decode_last_reduce_replays_in_cuda_graph(ordered):
    """Captured with the engine's max_seq_len bound (the split count of a graph), replayed twice
    on new queries and longer contexts: the reduce kernel's output each time (to a bf16 ulp), the
    counters at zero after each replay."""
    from pagedllm.kernels.attention_decode import decode_attention_triton
    from pagedllm.kernels.counters import counters

    dtype, hq, hkv, d, bs = torch.bfloat16, 32, 4, 128, 16
    seq_lens = [10, 700, 3000, 45]
    batch, num_blocks = make_batch([1] * 4, seq_lens, 4, bs, "cuda", seed=3)
    q, _, _, k_cache, v_cache = _attention_inputs(batch, num_blocks + 600, bs, hq, hkv, d, dtype, "cuda", 3)
    order = torch.tensor([2, 1, 3, 0], dtype=torch.int32, device="cuda") if ordered else None
    out = torch.empty_like(q)

    def run(dst, last):
        return decode_attention_triton(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, dst, d**-0.5,
                                       max_seq_len=8192, order=order, last_reduce=last)  # fmt: skip

    run(out, True)  # compiles, allocates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out, True)
    g = torch.Generator().manual_seed(9)
    for step in (1, 2):
        nxt, _ = make_batch([1] * 4, [s + step for s in seq_lens], 4, bs, "cuda", seed=4)
        batch.seq_lens.copy_(nxt.seq_lens)
        batch.block_tables.zero_()
        batch.block_tables[:, : nxt.block_tables.shape[1]].copy_(nxt.block_tables)
        q.copy_(_randn(*q.shape, dtype=dtype, device="cuda", gen=g))
        graph.replay()
        torch.cuda.synchronize()
        assert int(counters(q.device, 1).count_nonzero()) == 0
        merged = run(torch.empty_like(q), False)
        torch.testing.assert_close(out.float(), merged.float(), atol=1.6e-2, rtol=1.6e-2)
