"""Transformers configs of GGUF files whose architecture transformers' GGUF reader does not know
(it maps gpt2 and starcoder2 but not olmo2, glm4, granite or gptneox), built from the file's
metadata as llama.cpp's converter writes it (`{arch}.block_count`, `{arch}.rope.dimension_count`,
...) and from its tensors (the vocabulary from token_embd, biases and a tied head by presence);
and what transformers' reader leaves out for the ones it knows (StarCoder2's rope base)."""

from __future__ import annotations

from typing import Any


def _metadata(path: str) -> tuple[str, dict[str, Any], dict[str, tuple[int, ...]]]:
    """(architecture, its `{arch}.*` keys without the prefix plus the `tokenizer.ggml.*` ones,
    tensor name -> shape in torch order)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith(arch + "."):
            meta[key[len(arch) + 1:]] = field.contents()
        elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            meta[key] = field.contents()
    tensors = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    return arch, meta, tensors


def _config_class(arch: str):
    import transformers as T

    return {"olmo2": T.Olmo2Config, "glm4": T.Glm4Config, "granite": T.GraniteConfig,
            "gptneox": T.GPTNeoXConfig}.get(arch)


def gguf_only_config(path: str) -> Any | None:
    """The config of a GGUF file of OLMo 2, GLM-4, Granite or GPT-NeoX; None for another
    architecture (transformers reads those itself, or refuses them)."""
    arch, meta, tensors = _metadata(path)
    cls = _config_class(arch)
    if cls is None:
        return None
    heads = int(meta["attention.head_count"])
    hidden = int(meta["embedding_length"])
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    rope = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    rotary_dim = meta.get("rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        rope["partial_rotary_factor"] = int(rotary_dim) / head_dim
    kw: dict[str, Any] = dict(
        num_hidden_layers=int(meta["block_count"]), hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=int(meta["feed_forward_length"]), max_position_embeddings=int(meta["context_length"]),
        vocab_size=tensors["token_embd.weight"][0], tie_word_embeddings="output.weight" not in tensors,
        rope_parameters=rope,
    )
    for ours, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if key in meta:
            kw[ours] = int(meta[key])
    if arch == "gptneox":  # MHA, LayerNorm, the residual form as a key of its own
        kw.update(layer_norm_eps=float(meta["attention.layer_norm_epsilon"]),
                  use_parallel_residual=bool(meta.get("use_parallel_residual", True)))
    else:
        kw.update(num_key_value_heads=int(meta.get("attention.head_count_kv", heads)),
                  rms_norm_eps=float(meta["attention.layer_norm_rms_epsilon"]))
    if arch == "glm4":
        kw.update(head_dim=head_dim, attention_bias="blk.0.attn_q.bias" in tensors)
    if arch == "granite":  # the converter writes Granite's *_multiplier as *_scale
        kw.update(attention_bias="blk.0.attn_q.bias" in tensors,
                  attention_multiplier=float(meta.get("attention.scale", 1.0)),
                  embedding_multiplier=float(meta.get("embedding_scale", 1.0)),
                  residual_multiplier=float(meta.get("residual_scale", 1.0)),
                  logits_scaling=float(meta.get("logit_scale", 1.0)))
    cfg = cls(**kw)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


def complete_gguf_config(path: str, cfg: Any) -> None:
    """What transformers' reader gets wrong or leaves out of a config it builds: the vocabulary
    (it counts the tokenizer's tokens; token_embd's rows are the model's), GPT-2's context (it
    sets `n_ctx`, which GPT2Config ignores for n_positions), StarCoder2's rope base (its key
    map has no `rope.freq_base`) and Phi-3's window, partial rotary and LongRoPE factors."""
    _, meta, tensors = _metadata(path)
    if cfg.model_type == "phi3":
        _complete_phi3(path, cfg, meta, tensors)
    if "token_embd.weight" in tensors:
        cfg.vocab_size = tensors["token_embd.weight"][0]
    if cfg.model_type == "gpt2" and "context_length" in meta:
        cfg.n_positions = int(meta["context_length"])
    if cfg.model_type == "starcoder2" and "rope.freq_base" in meta:
        cfg.rope_parameters = {**(cfg.rope_parameters or {}), "rope_theta": float(meta["rope.freq_base"])}


def _complete_phi3(path: str, cfg: Any, meta: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> None:
    """Phi-3 / Phi-3.5 / Phi-4-mini as llama.cpp's converter writes them: `attention.sliding_window`,
    `rope.dimension_count` (the rotary dims: Phi-4-mini's 96 of 128), and for LongRoPE the
    `rope_factors_long` / `rope_factors_short` tensors with `rope.scaling.original_context_length`
    and `rope.scaling.attn_factor`; transformers' reader keeps none of them."""
    import gguf
    import numpy as np

    if meta.get("attention.sliding_window"):
        cfg.sliding_window = int(meta["attention.sliding_window"])
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rotary_dim = meta.get("rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor = int(rotary_dim) / head_dim
    if "rope_factors_long.weight" in tensors:
        factors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()
                   for t in gguf.GGUFReader(path).tensors if t.name.startswith("rope_factors_")}
        orig = int(meta.get("rope.scaling.original_context_length", cfg.max_position_embeddings))
        rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                    short_factor=factors["rope_factors_short.weight"], original_max_position_embeddings=orig)
        if meta.get("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(meta["rope.scaling.attn_factor"])
        cfg.original_max_position_embeddings = orig
    cfg.rope_parameters = rope
