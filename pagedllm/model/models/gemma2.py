"""Gemma 2 (and the base of Gemma 3's text model): the Llama decoder with Gemma's changes.

- RMSNorm scales by (1 + w): the checkpoint's w is stored as 1 + w at load, so the fused
  norm kernels run unchanged (in float32 the same product HF takes; in 16-bit floats 1 + w is
  rounded once, where HF keeps it in float32);
- four norms per layer: input -> attention -> post_attention, residual add, pre_feedforward
  -> MLP -> post_feedforward, residual add (the adds fused into the next norm);
- GeGLU with the tanh GELU; embeddings times sqrt(hidden_size) (rounded to the model dtype,
  like HF); attention scaled by query_pre_attn_scalar ** -0.5;
- attention logits soft-capped (attn_logit_softcapping) and the final logits too
  (final_logit_softcapping): c * tanh(x / c);
- interleaved sliding-window and global layers (`layer_types`; the window is `sliding_window`).

Layer index aware (Gemma 3's rope base differs per layer type), so the layers take it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.layers.activation import GeluTanhAndMul, act_into
from pagedllm.model.layers.attention import layer_sliding_window
from pagedllm.model.layers.layernorm import RMSNorm
from pagedllm.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_checked, materialize
from pagedllm.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


class GemmaRMSNorm(RMSNorm):
    """RMSNorm by (1 + w); the parameter holds 1 + w (dummy weights: 1, i.e. w = 0)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._load_plus_one  # type: ignore[attr-defined]

    @staticmethod
    def _load_plus_one(param: nn.Parameter, loaded, shard_id=None) -> None:
        w = materialize(loaded)
        copy_checked(param.data, (w.float() + 1.0).to(param.dtype))


def _activation_check(cfg: Any) -> None:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast"):
        raise ValueError(f"Gemma hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        _activation_check(cfg)
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=False, ps=ps)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False, ps=ps)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_into(self.act_fn, self.down_proj, self.gate_up_proj(x))


class Gemma2Attention(LlamaAttention):
    def __init__(self, cfg: Any, ps: ParallelState, layer_idx: int):
        super().__init__(cfg, ps)
        self.attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        cap = getattr(cfg, "attn_logit_softcapping", None)
        self.attn.logits_soft_cap = float(cap) if cap else None
        self.attn.sliding_window = layer_sliding_window(cfg, layer_idx)


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention
    norm_cls = GemmaRMSNorm  # also the model's final norm

    def __init__(self, cfg: Any, ps: ParallelState, layer_idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = self.attention_cls(cfg, ps, layer_idx)
        self.mlp = GemmaMLP(cfg, ps)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions, x, residual, batch):
        # x, residual: [T, H]; returns the MLP's normed output and the running residual
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, batch))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma2Model(LlamaModel):
    """Llama's stage-aware model (pipeline stages build only their layers) with Gemma's layers,
    its (1 + w) final norm and the embedding scaled by sqrt(hidden)."""

    layer_cls = Gemma2DecoderLayer

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps, make_layer=lambda i: self.layer_cls(cfg, ps, i))
        # sqrt(hidden) in the model dtype, as HF multiplies it (a buffer: follows .to())
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size**0.5), persistent=False)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer  # [T, H]


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model

    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        super().__init__(cfg, ps)
        cap = getattr(cfg, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)  # [S, V]
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits
