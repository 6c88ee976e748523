"""Writes a transformers model as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py)
does, unquantized, for the GGUF tests (tests/models/test_archs_gguf.py, test_moe_gguf.py): the
tensor names from the `gguf` package's own map (gguf.get_tensor_name_map), the converter's
metadata keys and its rewrites of the tensors (Llama / Mistral / Granite q and k rows
interleaved per head, GPT-2's Conv1D weights transposed and its tied head written out, GPT-NeoX's
fused qkv regrouped q | k | v, Gemma's norms stored as 1 + w, MoE experts stacked per
projection, Phi-3's LongRoPE factors as rope_factors_long / _short tensors). It is independent
of pagedllm's loader, which must read it back."""

from __future__ import annotations

import math

import numpy as np

import gguf

# transformers model_type -> gguf architecture
_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gpt_neox": "gptneox"}
_PERMUTED_ROPE = ("llama", "mistral", "granite")


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The converter's interleave of each head's two rotary halves (q / k rows of Llama)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    heads = cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
                              or 4 * cfg.hidden_size)
    w.add_head_count(heads)
    w.add_vocab_size(cfg.vocab_size)
    if arch not in ("gpt2", "gptneox"):
        w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" in rope and arch != "gemma3":
        w.add_rope_freq_base(float(rope["rope_theta"]))
    if getattr(cfg, "rms_norm_eps", None) is not None:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for eps_name in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
        if getattr(cfg, eps_name, None) is not None:
            w.add_layer_norm_eps(getattr(cfg, eps_name))
            break
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if "partial_rotary_factor" in rope:
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * (head_dim or cfg.hidden_size // heads)))
    if arch == "gemma3":
        w.add_rope_freq_base(10000.0)
    if arch.startswith("gemma") or (arch == "phi3" and cfg.sliding_window):
        w.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "longrope":  # Phi-3's: the factors go as tensors (_tensors)
        orig = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
    if arch == "gptneox":
        w.add_parallel_residual(cfg.use_parallel_residual)
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch.endswith("moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    # the converter writes the tokenizer too; its token list is what transformers' reader takes
    # the vocabulary size from (the tokens here are placeholders: the tests pass their tokenizer)
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, key, None), int):
            getattr(w, f"add_{key}")(getattr(cfg, key))


def _tensors(model, arch: str):
    """(GGUF name, array) in the converter's layout."""
    cfg = model.config
    tmap = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                    cfg.num_hidden_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "lm_head.weight" and tied and arch != "gpt2":
            continue  # a tied head is not written (GPT-2's converter writes wte again as output)
        if ".mlp.experts." in name:  # gate_up_proj [E, 2I, H] -> two stacks; down_proj [E, H, I]
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                i = a.shape[1] // 2
                yield f"blk.{layer}.ffn_gate_exps.weight", a[:, :i]
                yield f"blk.{layer}.ffn_up_exps.weight", a[:, i:]
            else:
                yield f"blk.{layer}.ffn_down_exps.weight", a
            continue
        out = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if out is None and name == "lm_head.weight":
            out = "output.weight"  # gguf lists no output for Gemma 2 (always tied in llama.cpp)
        assert out is not None, f"gguf has no name for {name}"
        if arch in _PERMUTED_ROPE and (".q_proj." in name or ".k_proj." in name):
            a = _permute(a, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        elif arch == "gpt2" and a.ndim == 2 and (".attn." in name or ".mlp." in name):
            a = a.T  # Conv1D [in, out] -> [out, in]
        elif arch == "gptneox" and "query_key_value" in name:  # rows [heads, 3, head_dim] -> q | k | v
            heads = cfg.num_attention_heads
            a = a.reshape(heads, 3, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0
        elif name.endswith("shared_expert_gate.weight"):
            a = a.reshape(-1)  # llama.cpp stores the shared expert's gate as [H]
        yield out, a
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)


def write_gguf(model, path: str, qtype: str | None = None) -> None:
    """`model`: a transformers causal LM (float32); its GGUF file at `path`, float32, or with
    every matrix whose rows split into whole blocks quantized to `qtype` (e.g. "Q8_0"; GPT-2's
    position table stays float32, as the converter keeps it)."""
    arch = _ARCH.get(model.config.model_type, model.config.model_type)
    w = gguf.GGUFWriter(path, arch)
    _write_metadata(w, model.config, arch)
    q = getattr(gguf.GGMLQuantizationType, qtype) if qtype else None
    for name, a in _tensors(model, arch):
        a = np.ascontiguousarray(a, dtype=np.float32)
        if q is not None and a.ndim == 2 and a.shape[1] % gguf.GGML_QUANT_SIZES[q][0] == 0 \
                and name != "position_embd.weight":
            data = gguf.quants.quantize(a, q)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q)
            continue
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
