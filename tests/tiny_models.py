"""Tiny random Llama / Qwen2 / Qwen3 checkpoints for the tests, written with transformers'
save_pretrained beside a saved tokenizer (conftest.py's `tokenizer_dir` fixture). A plain module,
not conftest.py: test modules import it by name, which resolves the same whichever directories
pytest is given (a `from conftest import` took the first conftest loaded, tests/server's after
`pytest tests/server tests/models`)."""

from __future__ import annotations

import os
import shutil

import torch

VOCAB = 49152


def tiny_config(
    arch: str,
    *,
    tie: bool = False,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    hidden: int = 64,
    head_dim: int | None = None,
    max_pos: int = 1024,
    **extra,
):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        initializer_range=0.3,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
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
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def copy_tokenizer(tokenizer_dir, out_dir) -> None:
    """The saved tokenizer's files beside a checkpoint in out_dir."""
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
