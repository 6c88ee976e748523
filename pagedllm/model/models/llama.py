"""Llama-family decoder (also the base of Qwen2 and Qwen3): embeddings, N x [RMSNorm ->
attention -> RMSNorm -> gated MLP] with the residual add fused into the norms, final norm,
LM head. Knows nothing of requests or blocks; attention reads the ForwardBatch it is given."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.attention.backend import ForwardBatch
from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.layernorm import RMSNorm
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.model.layers.rotary import get_rotary_embedding, rope_parameters


class LlamaAttention(nn.Module):
    qkv_bias_default = False
    use_qk_norm = False

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        hidden = cfg.hidden_size
        num_heads = cfg.num_attention_heads
        num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // num_heads
        bias = bool(getattr(cfg, "attention_bias", self.qkv_bias_default)) or self.qkv_bias_default
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv, bias=bias, ps=ps)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        o_bias = bool(getattr(cfg, "attention_bias", False)) and not self.qkv_bias_default
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=o_bias, ps=ps)
        max_pos = int(getattr(cfg, "max_position_embeddings", 4096))
        self.rotary_emb = get_rotary_embedding(self.head_dim, max_pos, rope_parameters(cfg))
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        inter = cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=bias, ps=ps)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, ps=ps)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, ps)
        self.mlp = LlamaMLP(cfg, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, batch):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.run_mlp(x, batch), residual

    def run_mlp(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.mlp(x)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps)
        self.layers = nn.ModuleList([self.layer_cls(cfg, ps) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, batch):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # checkpoint name -> (our fused parameter name, shard id)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, cfg: Any, ps: ParallelState = SINGLE):
        super().__init__()
        self.config = cfg
        self.model = self.model_cls(cfg, ps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # -> hidden states [T, H]
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into parameters; returns the names of parameters loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for ckpt, ours, shard in self.stacked_params:
                if f".{ckpt}." in name:
                    target = name.replace(f".{ckpt}.", f".{ours}.")
                    if target not in params:
                        raise ValueError(f"checkpoint tensor {name} has no parameter {target}")
                    p = params[target]
                    p.weight_loader(p, tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name} matches no parameter of {type(self).__name__}")
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, tensor)
                loaded.add(name)
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
