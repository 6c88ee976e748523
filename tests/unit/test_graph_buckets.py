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


@pytest.mark.parametrize("value, on", [("", True), ("0", False), ("1", True), ("yes", None)])
def test_context_buckets_switch(monkeypatch, value, on):
    monkeypatch.setenv("PAGEDLLM_GRAPH_CONTEXT_BUCKETS", value)
    cuda_graph.context_buckets.cache_clear()
    try:
        if on is None:
            with pytest.raises(ValueError, match="PAGEDLLM_GRAPH_CONTEXT_BUCKETS"):
                cuda_graph.context_buckets()
        else:
            assert cuda_graph.context_buckets() is on
    finally:
        cuda_graph.context_buckets.cache_clear()
