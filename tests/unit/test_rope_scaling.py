"""The scaled rope types against transformers' own ROPE_INIT_FUNCTIONS: the same inverse
frequencies and attention factor (YaRN with and without mscale, LongRoPE's short and long sets,
dynamic NTK at the engine's max_model_len, linear, llama3), and the derived max_model_len."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.layers.rotary import _inv_freq, rope_max_positions, rope_parameters

HEAD_DIM = 64


def _cfg(rope: dict, max_pos: int = 4096, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                       rope_parameters={"rope_theta": 500000.0, **rope}, **extra)


def _hf(cfg, seq_len=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, "cpu", seq_len=seq_len)


LONG = [1.0 + i / 5 for i in range(HEAD_DIM // 2)]
SHORT = [1.0 + i / 50 for i in range(HEAD_DIM // 2)]


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
])
def test_static_types_equal_transformers(rope):
    cfg = _cfg(rope)
    inv, factor = _inv_freq(HEAD_DIM, rope_parameters(cfg))
    ref_inv, ref_factor = _hf(cfg)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)


@pytest.mark.parametrize("max_model_len,long", [(4096, False), (131072, True)])
def test_longrope_factor_set_follows_max_model_len(max_model_len, long):
    cfg = _cfg({"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT,
                "original_max_position_embeddings": 4096}, max_pos=131072)
    cfg.pagedllm_max_model_len = max_model_len
    inv, factor = _inv_freq(HEAD_DIM, rope_parameters(cfg))
    ref_inv, ref_factor = _hf(cfg, seq_len=4097 if long else None)  # HF's rule at a length past / within 4096
    torch.testing.assert_close(inv, ref_inv, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor) and factor > 1.0


def test_dynamic_ntk_is_plain_within_the_context_and_hf_at_max_model_len():
    cfg = _cfg({"rope_type": "dynamic", "factor": 2.0})
    plain, _ = _inv_freq(HEAD_DIM, dict(rope_parameters(cfg), rope_type="default"))
    cfg.pagedllm_max_model_len = 4096
    torch.testing.assert_close(_inv_freq(HEAD_DIM, rope_parameters(cfg))[0], plain)
    cfg.pagedllm_max_model_len = 8192
    ref, _ = _hf(cfg, seq_len=8192)
    torch.testing.assert_close(_inv_freq(HEAD_DIM, rope_parameters(cfg))[0], ref, rtol=1e-6, atol=0)


def test_derived_max_model_len_as_vllm():
    assert rope_max_positions(_cfg({"rope_type": "default"})) == 4096
    assert rope_max_positions(_cfg({"rope_type": "linear", "factor": 4.0})) == 16384
    assert rope_max_positions(_cfg({"rope_type": "dynamic", "factor": 2.0})) == 8192
    assert rope_max_positions(_cfg({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                                   max_pos=32768)) == 131072
    assert rope_max_positions(_cfg({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                   max_pos=131072)) == 131072


def test_unknown_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        _inv_freq(HEAD_DIM, {"rope_type": "mrope", "rope_theta": 10000.0})
