"""Qwen3-MoE and Qwen2-MoE from GGUF files (experts stacked per projection, as llama.cpp writes
them: ffn_{gate,up,down}_exps, the router ffn_gate_inp, the shared expert *_shexp) greedy-equal
to the transformers model the file was written from, float32 on the CPU. The files are written
here by tests/gguf_writer.py, unquantized."""

from __future__ import annotations

import pytest

from moe_utils import save_moe_model, tiny_moe_config
from pagedllm import LLM
from test_hf_equivalence import check, prompts_of

gguf = pytest.importorskip("gguf")
from gguf_writer import write_gguf  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.extended)])
def test_moe_from_gguf(arch, tmp_path, tokenizer_dir):
    # every layer sparse: GGUF does not say which layers are dense (mlp_only_layers)
    path, hf = save_moe_model(tiny_moe_config(arch, mlp_only_layers=[]), str(tmp_path / "hf"), tokenizer_dir, seed=4)
    gguf_path = str(tmp_path / "model.gguf")
    write_gguf(hf.hf, gguf_path)
    llm = LLM(gguf_path, tokenizer=path, kv_cache_memory="8MiB", max_model_len=512)
    assert llm.llm_engine.config.model_config.load_format == "gguf"
    check(llm, hf, prompts_of([7, 30], seed=9))
