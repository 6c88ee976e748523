"""The decode kernel's config table and its PAGEDLLM_DECODE_CONFIG override (benchmarks/decode_gpu.sh
sets it to compare tiles in the engine)."""

import pytest

from pagedllm.kernels import attention_decode, attention_merge


@pytest.fixture(autouse=True)
def _fresh_cache():
    attention_decode.decode_config.cache_clear()
    yield
    attention_decode.decode_config.cache_clear()


@pytest.mark.parametrize("raw,want", [("256,8,4", (256, 8, 4, None)), (" 64, 4, 3", (64, 4, 3, None)),
                                      ("128,4,3,96", (128, 4, 3, 96))])
def test_override(monkeypatch, raw, want):
    monkeypatch.setenv("PAGEDLLM_DECODE_CONFIG", raw)
    assert attention_decode.decode_config(1) == want
    assert attention_decode.decode_config(2) == want


@pytest.mark.parametrize("raw", ["64,4", "48,4,2", "a,b,c", "8,4,2", "mma,64,4,2", "64,0,2", "128,4,3,16",
                                 "128,4,3,96,1"])
def test_bad_override_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDLLM_DECODE_CONFIG", raw)
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_CONFIG"):
        attention_decode.decode_config(2)


@pytest.mark.parametrize("env,want", [("", {(4, 2): True, (9, 2): True, (10, 2): False, (32, 2): False,
                                           (4, 1): False, (4, 4): False}),
                                      ("1", {(32, 2): True, (4, 1): True}), ("0", {(4, 2): False})])
def test_last_reduce_rule(monkeypatch, env, want):
    """The last split merges the splits of 16-bit caches split at most LAST_REDUCE_MAX_SPLITS ways
    (the H200's measured wins), not FP8 or float32 ones; PAGEDLLM_DECODE_LAST_REDUCE=1/0 forces it."""
    monkeypatch.setenv("PAGEDLLM_DECODE_LAST_REDUCE", env)
    attention_merge._last_reduce_forced.cache_clear()
    try:
        for (splits, itemsize), on in want.items():
            assert attention_merge.decode_last_reduce(splits, itemsize) == on, (splits, itemsize)
    finally:
        attention_merge._last_reduce_forced.cache_clear()


@pytest.mark.parametrize("env", ["", "1"])
def test_last_reduce_keeps_the_reduce_kernel_for_16_wide_heads(monkeypatch, env):
    """Heads narrower than LAST_REDUCE_MIN_BLOCK_D keep the reduce kernel even when forced (Triton 3.6
    cannot compile the merge at BLOCK_D 16); 32 and wider follow the rule."""
    monkeypatch.setenv("PAGEDLLM_DECODE_LAST_REDUCE", env)
    attention_merge._last_reduce_forced.cache_clear()
    try:
        assert not attention_merge.decode_last_reduce(4, 2, 16)
        assert attention_merge.decode_last_reduce(4, 2, 32) and attention_merge.decode_last_reduce(4, 2, 128)
    finally:
        attention_merge._last_reduce_forced.cache_clear()


@pytest.mark.parametrize("env,want", [("1", {(128, 132): True, (264, 132): True, (265, 132): False,
                                            (2048, 132): False}),
                                      ("", {(128, 132): True, (2048, 132): False}), ("0", {(128, 132): False})])
def test_preload_rule(monkeypatch, env, want):
    """PAGEDLLM_DECODE_PRELOAD unset or 1: the ROPE decode kernel preloads its first tile for grids of at
    most PRELOAD_MAX_WAVES programs an SM (batch-1 decodes), not full ones; 0 never."""
    monkeypatch.setenv("PAGEDLLM_DECODE_PRELOAD", env)
    attention_decode._preload_on.cache_clear()
    try:
        for (programs, sms), on in want.items():
            assert attention_decode.decode_preload(programs, sms) == on, (programs, sms)
    finally:
        attention_decode._preload_on.cache_clear()


def test_preload_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DECODE_PRELOAD", "yes")
    attention_decode._preload_on.cache_clear()
    try:
        with pytest.raises(ValueError, match="PAGEDLLM_DECODE_PRELOAD"):
            attention_decode.decode_preload(1, 132)
    finally:
        attention_decode._preload_on.cache_clear()
