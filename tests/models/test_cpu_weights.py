"""How the loader prepares a model on the CPU: MKL-packed copies of every projection and the LM
head in float32 (none in bfloat16, none when turned off), and one rotary embedding shared by
all layers."""

from __future__ import annotations

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm.kernels import cpu_gemm

needs_mkl = pytest.mark.skipif(not cpu_gemm.available(), reason="torch is not linked with MKL")


def _tiny_model(tmp_path, tokenizer_dir, dtype="float32"):
    from pagedllm.config import EngineArgs
    from pagedllm.model.loader import build_model

    path = save_tiny_model(tiny_config("llama", tie=True, layers=3), str(tmp_path), tokenizer_dir, seed=3)
    return build_model(EngineArgs(model=path, dtype=dtype).create_engine_config().model_config, "cpu")


@needs_mkl
def test_loader_packs_every_projection_and_the_lm_head(tmp_path, tokenizer_dir, monkeypatch):
    model = _tiny_model(tmp_path, tokenizer_dir)
    holders = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert len(holders) == 3 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
    assert all(isinstance(m.packed_weight, cpu_gemm.PackedWeight) for m in holders)
    monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "0")
    assert not cpu_gemm.available()
    model = _tiny_model(tmp_path / "off", tokenizer_dir)
    assert all(m.packed_weight is None for m in model.modules() if hasattr(m, "packed_weight"))


def test_loader_packs_nothing_in_bfloat16(tmp_path, tokenizer_dir):
    model = _tiny_model(tmp_path, tokenizer_dir, dtype="bfloat16")
    assert all(m.packed_weight is None for m in model.modules() if hasattr(m, "packed_weight"))


def test_layers_share_one_rotary_embedding(tmp_path, tokenizer_dir):
    from pagedllm.model.layers.rotary import RotaryEmbedding

    model = _tiny_model(tmp_path, tokenizer_dir)
    ropes = {id(m) for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert len(ropes) == 1
    other = _tiny_model(tmp_path / "bf16", tokenizer_dir, dtype="bfloat16")
    assert len({id(m) for m in other.modules() if isinstance(m, RotaryEmbedding)}) == 1
