"""Qwen3-MoE and Qwen2-MoE from GGUF files (experts stacked per projection, as llama.cpp writes
them: ffn_{gate,up,down}_exps, the router ffn_gate_inp, the shared expert *_shexp) greedy-equal
to the transformers model the file was written from, float32 on the CPU. The files are written
here with the `gguf` package's writer, unquantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_utils import save_moe_model, tiny_moe_config
from pagedllm import LLM
from test_hf_equivalence import check, prompts_of

gguf = pytest.importorskip("gguf")

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(hf, path: str) -> None:
    cfg = hf.config
    arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}[cfg.model_type]
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen3moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if module == "mlp.experts":  # gate_up_proj [E, 2I, H] -> two stacks; down_proj [E, H, I]
                if suffix == "gate_up_proj":
                    i = a.shape[1] // 2
                    w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :i]))
                    w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(a[:, i:]))
                else:
                    w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", a)
                continue
            if module == "mlp.shared_expert_gate":
                a = a.reshape(-1)  # llama.cpp stores the shared expert's gate as [H]
            gname = f"blk.{layer}.{_LAYER[module]}.{suffix}"
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.extended)])
def test_moe_from_gguf(arch, tmp_path, tokenizer_dir):
    # every layer sparse: GGUF does not say which layers are dense (mlp_only_layers)
    path, hf = save_moe_model(tiny_moe_config(arch, mlp_only_layers=[]), str(tmp_path / "hf"), tokenizer_dir, seed=4)
    gguf_path = str(tmp_path / "model.gguf")
    write_gguf(hf.hf, gguf_path)
    llm = LLM(gguf_path, tokenizer=path, kv_cache_memory="8MiB", max_model_len=512)
    assert llm.llm_engine.config.model_config.load_format == "gguf"
    check(llm, hf, prompts_of([7, 30], seed=9))
