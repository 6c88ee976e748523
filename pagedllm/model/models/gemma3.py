"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2's decoder with RMSNorm (1 + w) on each head of q
and k before rotary, no soft-capping in released configs, 5 sliding-window layers to 1 global
(`layer_types`), and two rotary embeddings: the local base (10,000) on sliding layers and the
global base (1,000,000, with linear scaling in the larger models) on global ones.

`Gemma3ForConditionalGeneration` (gemma-3-4b/12b/27b, SigLIP vision tower + projector + this
text model): its text model alone, from the config's `text_config` (model/loader.py's
`text_part`) and the checkpoint's language-model tensors; images are not served."""

from __future__ import annotations

from typing import Any, Iterable

from pagedllm.distributed import ParallelState
from pagedllm.model.layers.rotary import get_rotary_embedding, rope_parameters
from pagedllm.model.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
    GemmaRMSNorm,
)


class Gemma3Attention(Gemma2Attention):
    use_qk_norm = True

    def __init__(self, cfg: Any, ps: ParallelState, layer_idx: int):
        super().__init__(cfg, ps, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        types = getattr(cfg, "layer_types", None)
        layer_type = types[layer_idx] if types is not None else "full_attention"
        rope = rope_parameters(cfg, layer_type)
        if layer_type == "sliding_attention" and "rope_local_base_freq" in vars(cfg):  # older configs
            rope["rope_theta"] = float(cfg.rope_local_base_freq)
        self.rotary_emb = get_rotary_embedding(self.head_dim, rope["max_model_len"], rope)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model


# where a vision-language checkpoint keeps its text model (4.x and 5.x names) -> ours
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIXES):
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            yield name, tensor
