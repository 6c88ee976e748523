"""The decode kernel's config table and its PAGEDLLM_DECODE_CONFIG override (benchmarks/decode_gpu.sh
sets it to compare tiles in the engine)."""

import pytest

from pagedllm.kernels import attention_decode


@pytest.fixture(autouse=True)
def _fresh_cache():
    attention_decode.decode_config.cache_clear()
    yield
    attention_decode.decode_config.cache_clear()


@pytest.mark.parametrize("raw,want", [("256,8,4", (256, 8, 4)), (" 64, 4, 3", (64, 4, 3))])
def test_override(monkeypatch, raw, want):
    monkeypatch.setenv("PAGEDLLM_DECODE_CONFIG", raw)
    assert attention_decode.decode_config(1) == want
    assert attention_decode.decode_config(2) == want


@pytest.mark.parametrize("raw", ["64,4", "48,4,2", "a,b,c", "8,4,2", "mma,64,4,2", "64,0,2"])
def test_bad_override_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDLLM_DECODE_CONFIG", raw)
    with pytest.raises(ValueError, match="PAGEDLLM_DECODE_CONFIG"):
        attention_decode.decode_config(2)
