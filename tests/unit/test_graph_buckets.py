"""Which max_seq_len bounds the decode CUDA graphs are captured for (worker/cuda_graph.py), from the
decode kernel's split rule: a bound below max_model_len only for the batch sizes whose split count
it changes; and the switch's values. (The graphs themselves: tests/gpu/test_engine_gpu.py.)"""

from __future__ import annotations

import pytest

from pagedllm.kernels.attention_decode import decode_num_splits
from pagedllm.worker import cuda_graph


def test_context_bounds_follow_the_split_rule():
    sizes = cuda_graph.batch_size_ladder(256)

    def splits(hkv_list):  # an H200's 132 SMs
        return lambda bs, bound: tuple(decode_num_splits(bs, hkv, bound, 132) for hkv in hkv_list)

    bounds = cuda_graph.context_bounds(sizes, 4096, splits([4]))  # Qwen3-30B-A3B's 4 kv heads
    assert bounds[1] == [1024, 4096]  # 8 splits (merged by the last) against 32 and a reduce kernel
    assert bounds[64] == [4096]  # 2 splits at every bound
    assert all(b[-1] == 4096 and b == sorted(b) for b in bounds.values())
    assert cuda_graph.context_bounds(sizes, 32768, splits([8]))[1] == [1024, 4096, 32768]
    assert cuda_graph.context_bounds(sizes, 512, splits([8]))[1] == [512]  # no bucket below it
    # a layer whose split count a bound changes is enough (a window caps the others' span)
    assert cuda_graph.context_bounds([2], 4096, lambda bs, b: (1, min(b, 2048)))[2] == [1024, 4096]


@pytest.mark.parametrize("value, want", [("", cuda_graph.CONTEXT_BUCKETS), ("1", cuda_graph.CONTEXT_BUCKETS),
                                         ("0", ()), ("4096, 512,1024", (512, 1024, 4096)), ("768", (768,)),
                                         ("yes", None), ("512,", None), ("512,-1", None), ("0,512", None)])
def test_context_buckets_switch(monkeypatch, value, want):
    monkeypatch.setenv("PAGEDLLM_GRAPH_CONTEXT_BUCKETS", value)
    cuda_graph.context_buckets.cache_clear()
    try:
        if want is None:
            with pytest.raises(ValueError, match="PAGEDLLM_GRAPH_CONTEXT_BUCKETS"):
                cuda_graph.context_buckets()
        else:
            assert cuda_graph.context_buckets() == want
    finally:
        cuda_graph.context_buckets.cache_clear()


def test_context_bounds_of_other_buckets():
    """A 512-token bucket below the default ones: batch 1 of 4 kv heads at max_model_len 4,096 captures
    4 splits at 512, 8 at 1,024 and 32 at 4,096; no buckets, max_model_len alone."""

    def splits(bs, bound):
        return (decode_num_splits(bs, 4, bound, 132),)

    assert cuda_graph.context_bounds([1], 4096, splits, (512, 1024, 4096))[1] == [512, 1024, 4096]
    assert [splits(1, b)[0] for b in (512, 1024, 4096)] == [4, 8, 32]
    assert cuda_graph.context_bounds([1, 64], 4096, splits, ()) == {1: [4096], 64: [4096]}
