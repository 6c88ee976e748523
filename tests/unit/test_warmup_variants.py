"""worker/warmup.py's enumeration of the decode kernel variants that mixed steps take (the warm-up
itself runs on CUDA: tests/gpu/test_warmup_gpu.py), and how recorded_compiles names a compile."""

from __future__ import annotations

import random

import pytest

from pagedllm.kernels.attention_decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT
from pagedllm.worker.warmup import mixed_step_variants


def _key(kinds, nd, bound, sms, ordered):
    """A step's variant, from the kernel's own rules (decode_num_splits, decode_last_reduce)."""
    from pagedllm.kernels.attention_decode import decode_num_splits
    from pagedllm.kernels.attention_merge import decode_last_reduce

    parts = []
    for hkv, window, itemsize, block_d in kinds:
        s = decode_num_splits(nd, hkv, min(bound, window) if window else bound, sms)
        parts.append((s > 1, s > 1 and decode_last_reduce(s, itemsize, block_d)))
    return (ordered and nd >= 2, tuple(parts))


@pytest.mark.parametrize("kinds,max_decodes,max_model_len,ordered", [
    ([(8, 0, 2, 128)], 255, 2048, True),  # Llama-3.1-8B, W1's engine
    ([(4, 0, 2, 128)], 15, 4096, True),  # Qwen3-30B-A3B
    ([(2, 0, 1, 64), (2, 512, 1, 64)], 63, 8192, True),  # an FP8 cache, sliding layers beside global ones
    ([(8, 0, 4, 128)], 7, 300, False),  # float32, unordered, a short max_model_len
])  # fmt: skip
def test_every_mixed_step_takes_a_warmed_variant(kinds, max_decodes, max_model_len, ordered):
    """Any mixed step (1..max_decodes decodes, any context up to max_model_len, not only the
    enumeration's bounds) takes a variant the warm-up runs, and each variant's representative
    (the fewest decodes) takes its own variant."""
    sms = 132
    variants = mixed_step_variants(kinds, max_decodes, max_model_len, sms, ordered)
    for key, (nd, bound) in variants.items():
        assert 1 <= nd <= max_decodes and bound <= max_model_len and _key(kinds, nd, bound, sms, ordered) == key
        assert not any(_key(kinds, m, bound, sms, ordered) == key for m in range(1, nd))
    rng = random.Random(0)
    for _ in range(3000):
        nd, ctx = rng.randint(1, max_decodes), rng.randint(1, max_model_len)
        assert _key(kinds, nd, ctx, sms, ordered) in variants, (nd, ctx)
    # with splits, both ways of merging them where the counts allow it (the bf16 Llama engine's case)
    if kinds == [(8, 0, 2, 128)]:
        assert {k[1][0] for k in variants} == {(False, False), (True, True), (True, False)}
        assert len(variants) == 6  # each of the three, with one decode (unordered) and with more
    assert max(b for _, b in variants.values()) <= min(max_model_len, MIN_TOKENS_PER_SPLIT * MAX_SPLITS)


def test_compiled_text_names_the_constexprs():
    """recorded_compiles' line for a compile: the kernel's name and options, then its constexpr
    arguments by name (Triton's repr gives neither value), from the JIT cache hook's arguments; a
    Triton whose hook passes other arguments gets its repr as it is."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JitFunctionInfo

    from pagedllm.kernels._triton import _compiled_text
    from pagedllm.kernels.attention_decode import _decode_kernel

    index = {p.name: p.num for p in _decode_kernel.params}
    repr_ = "_decode_kernel[num_warps=4, num_ctas=1, num_stages=2](q_ptr: (), k_cache_ptr: ()"
    kwargs = {"repr": repr_, "fn": JitFunctionInfo(_decode_kernel.fn.__module__, "_decode_kernel", _decode_kernel),
              "compile": {"constants": {(index["SPLIT"],): True, (index["ORDERED"],): False,
                                        (index["q_ptr"],): None}}}  # fmt: skip
    assert _compiled_text(kwargs) == "_decode_kernel[num_warps=4, num_ctas=1, num_stages=2](SPLIT=True, ORDERED=False)"
    assert _compiled_text({"repr": repr_}) == repr_
