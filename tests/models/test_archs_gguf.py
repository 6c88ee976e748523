"""Gemma 2, Gemma 3 and Phi-3 from GGUF files and as dummy weights. GGUF: a tiny random HF model written as GGUF the way
llama.cpp's converter names it (Gemma's norms stored as 1 + w, Phi-3's fused attn_qkv and
ffn_up), loaded by pagedllm: greedy token ids equal transformers' run of the original weights
under the config transformers reads from that GGUF file (its GGUF loader itself drops Gemma's
untied output.weight, so it is no reference)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm import LLM
from test_archs_equivalence import ENGINE, _config, save_model
from test_hf_equivalence import check, prompts_of

gguf = pytest.importorskip("gguf")

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(hf_dir: str, path: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    arch = "gemma3" if cfg.model_type == "gemma3_text" else cfg.model_type
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    if gemma:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    layer = {**_LAYER, **(_GEMMA_LAYER if gemma else {"post_attention_layernorm": "ffn_norm"})}
    for name, p in model.state_dict().items():
        if name in _TOP:
            out = _TOP[name]
        else:
            parts = name.split(".")
            out = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.{parts[-1]}"
        data = p.float().numpy()
        if gemma and name.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(out, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_gguf_equals_transformers_gguf_loader(name, tmp_path, tokenizer_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = save_model(_config(name), str(tmp_path / "hf"), tokenizer_dir)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(hf_dir, path)
    cfg = AutoConfig.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.load_state_dict(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict())
    llm = LLM(path, tokenizer=tokenizer_dir, **ENGINE)
    assert llm.llm_engine.config.model_config.architecture == type(hf).__name__
    check(llm, hf, prompts_of([7, 40, 70], seed=1))


@pytest.mark.parametrize("name", ["gemma2", pytest.param("gemma3", marks=pytest.mark.extended), "phi3"])
def test_dummy_weights(name, tmp_path, tokenizer_dir):
    """load_format="dummy" from a config alone (what the benchmarks run): every parameter is
    filled (Gemma's norms as 1 + 0), another seed gives other weights, so other tokens."""
    import shutil

    cfg = _config(name)
    cfg.architectures = [{"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}[name]]
    cfg.save_pretrained(str(tmp_path))
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), tmp_path)
    prompts = prompts_of([5, 30], seed=2)
    from test_hf_equivalence import GREEDY

    runs = []
    for seed in (0, 1):
        llm = LLM(str(tmp_path), load_format="dummy", seed=seed, **ENGINE)
        model = llm.llm_engine.executor.worker.model
        assert all(torch.isfinite(p).all() for p in model.parameters())
        norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
        assert norms and all(bool((p == 1).all()) for p in norms)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] != runs[1]
    assert all(len(t) == GREEDY.max_tokens for t in runs[0])
