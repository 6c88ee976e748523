"""Tiny random mixture-of-experts checkpoints for the tests (Qwen3-MoE, Qwen2-MoE, Mixtral),
written by transformers, with the SmolLM2 tokenizer beside them."""

from __future__ import annotations

import os

import torch
from tiny_models import VOCAB, copy_tokenizer


def tiny_moe_config(arch: str, **extra):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2, num_experts_per_tok=2, tie_word_embeddings=False)
    common.update(extra)
    if arch == "qwen3_moe":
        # layer 0 dense (mlp_only_layers), top-3 of 8 renormalized
        kw = dict(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
                  mlp_only_layers=[0], num_hidden_layers=3)
        kw.update(common, num_experts_per_tok=3, num_hidden_layers=3)
        return Qwen3MoeConfig(**kw)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8, norm_topk_prob=False,
                              shared_expert_intermediate_size=48, **common)
    if arch == "mixtral":
        return MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
    raise ValueError(arch)


def save_moe_model(cfg, out_dir: str, tokenizer_dir: str, seed: int = 1, stacked: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if stacked:  # transformers' own layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        hf.config.architectures = [type(hf).__name__]
        hf.config.save_pretrained(out_dir)
        state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or not cfg.tie_word_embeddings}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, os.path.join(out_dir, "model.safetensors"))
    else:
        hf.save_pretrained(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir, MemoGenerate(hf)


class MemoGenerate:
    """The transformers model, its greedy `generate` remembered per prompt: the tests of one
    model ask for the same prompts under different engine settings, and the reference is the
    slowest part of them."""

    def __init__(self, hf):
        self.hf, self.config, self._seen = hf, hf.config, {}

    def generate(self, input_ids, **kw):
        key = (tuple(input_ids[0].tolist()), kw.get("max_new_tokens"))
        if key not in self._seen:
            self._seen[key] = self.hf.generate(input_ids, **kw)
        return self._seen[key]

    def parameters(self):
        return self.hf.parameters()
