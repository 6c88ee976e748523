"""The model registry: an unknown architecture gets one error naming every supported one, each
registered class imports, and the README's model table is the one the registry generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.model.registry import get_model_class, model_table, resolve_architecture, supported_architectures

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError) as err:
        resolve_architecture(["FalconForCausalLM", "BertModel"])
    msg = str(err.value)
    assert "FalconForCausalLM" in msg and "not supported" in msg
    for arch in supported_architectures():
        assert arch in msg


def test_first_supported_architecture_wins():
    assert resolve_architecture(["Unknown", "GPT2LMHeadModel", "LlamaForCausalLM"]) == "GPT2LMHeadModel"


def test_engine_config_refuses_an_unknown_architecture(tmp_path):
    import json

    from pagedllm.config import EngineArgs

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="supported architectures: .*GPTNeoXForCausalLM"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_registered_class_imports(arch):
    cls = get_model_class(arch)
    assert callable(getattr(cls, "load_weights")) and callable(getattr(cls, "compute_logits"))


def test_readme_model_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert model_table() in readme, "README.md's model table is stale: paste `python -m pagedllm.model.registry`"
