"""OLMo 2: the Llama decoder with the norms after each block instead of before it,

    h = x + post_attention_layernorm(attn(x));   out = h + post_feedforward_layernorm(mlp(h))

and RMSNorm over the whole q and the whole k projection (all heads together, before rotary).
Under tensor parallelism each rank holds some heads, so those two norms all-reduce their sum
of squares (a replicated kv head counted once)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import ForwardBatch
from pagedllm.distributed import ParallelState
from pagedllm.kernels.norm import rms_norm
from pagedllm.model.layers.layernorm import RMSNorm
from pagedllm.model.layers.linear import copy_checked
from pagedllm.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, norm_eps


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across ranks in blocks of `local` features (block
    tp_rank // replicas on each rank); plain rms_norm at world size 1."""

    def __init__(self, local: int, replicas: int, eps: float, ps: ParallelState):
        super().__init__()
        self.ps, self.local, self.replicas, self.eps = ps, local, replicas, eps
        self.width = local * ps.tp_size // replicas
        self.weight = nn.Parameter(torch.ones(local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if int(loaded.shape[0]) != self.width:
            raise ValueError(f"norm weight shape mismatch: model ({self.width},), checkpoint {tuple(loaded.shape)}")
        block = self.ps.tp_rank // self.replicas
        copy_checked(param.data, loaded.narrow(0, block * self.local, self.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, local] -> [T, local]
        if self.ps.tp_size == 1:
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        sum_sq = self.ps.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.replicas  # [T, 1]
        y = xf * torch.rsqrt(sum_sq / self.width + self.eps)
        return self.weight * y.to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        self.q_norm = ShardedRMSNorm(self.q_size, 1, norm_eps(cfg), ps)
        self.k_norm = ShardedRMSNorm(self.kv_size, self.qkv_proj.kv_replicas, norm_eps(cfg), ps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_norm(k).reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__(cfg, ps)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, norm_eps(cfg))

    def forward(self, positions, x, residual, batch):
        # x + residual is the layer's input (the previous layer's normed MLP output + its residual)
        h = x if residual is None else residual + x
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, batch))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
