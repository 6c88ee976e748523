"""Llama-family decoder (also the base of Qwen2 and Qwen3): embeddings, N x [RMSNorm ->
attention -> RMSNorm -> gated MLP] with the residual add fused into the norms, final norm,
LM head. Knows nothing of requests or blocks; attention reads the ForwardBatch it is given.

The other decoders are this one with its parts swapped through class attributes and small
overrides, not copies of it: the norm (`norm_cls`: RMSNorm or LayerNorm), the MLP (`mlp_cls`),
the attention's biases and positions (`biases`, `make_rotary`), the embedding (`embed`) and the
checkpoint's names (`checkpoint_weights`). A partial or interleaved rotary permutes the q/k
rows at load (model/layers/partial_rotary.py).

Under pipeline parallelism it builds only the layers its stage owns (`ps.layer_range`), takes
the previous stage's (hidden, residual) instead of token ids past the first stage, and returns
them, un-normed, before the last."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from pagedllm.attention.backend import ForwardBatch
from pagedllm.distributed import SINGLE, ParallelState
from pagedllm.kernels._triton import fusion_enabled
from pagedllm.model.layers.activation import SiluAndMul, act_into
from pagedllm.model.layers.attention import Attention, layer_sliding_window
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.layernorm import RMSNorm, norm_into
from pagedllm.model.layers.pipeline import belongs_elsewhere, make_layers, owned_layers
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagedllm.model.layers.partial_rotary import partial_rotary_permutation, permuted_head_rows
from pagedllm.model.layers.rotary import RotaryEmbedding, get_rotary_embedding, rope_parameters, rotary_dim_of


def norm_eps(cfg: Any) -> float:
    """The norms' epsilon under any of the names transformers configs give it."""
    for name in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "layer_norm_epsilon"):
        eps = getattr(cfg, name, None)
        if eps is not None:
            return float(eps)
    return 1e-6


class LlamaAttention(nn.Module):
    qkv_bias_default = False
    use_qk_norm = False
    rotary_interleaved = False  # rotary pairs (2i, 2i + 1) (GPT-J / GLM) instead of (i, i + r/2)

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        hidden = cfg.hidden_size
        num_heads = cfg.num_attention_heads
        num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // num_heads
        qkv_bias, o_bias = self.biases(cfg)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv, bias=qkv_bias, ps=ps)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=o_bias, ps=ps)
        self.rotary_emb = self.make_rotary(cfg)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.fuse_rope_kv_requested = fusion_enabled("ROPE_KV")

    @property
    def fuse_rope_kv(self) -> bool:
        """[q/k norm +] rotary + store-KV in one kernel on the GPU (PAGEDLLM_FUSED_ROPE_KV=0: off), for
        the plain rotary and RMSNorm only (no rotary, or Gemma 3's (1 + w) norm, which a
        subclass sets after this class's __init__: the unfused path)."""
        return (self.fuse_rope_kv_requested and type(self.rotary_emb) is RotaryEmbedding
                and (not self.use_qk_norm or type(self.q_norm) is type(self.k_norm) is RMSNorm))

    @property
    def input_linear(self) -> nn.Module | None:
        """The one consumer of forward's x (so the norm before may hand it FP8 rows: norm_into);
        None for a subclass with a forward of its own."""
        return self.qkv_proj if type(self).forward is LlamaAttention.forward else None

    def biases(self, cfg: Any) -> tuple[bool, bool]:
        """(q/k/v projections have a bias, o_proj has one)."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias or self.qkv_bias_default, bias and not self.qkv_bias_default

    def make_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        """The rotary embedding (None: positions enter elsewhere, e.g. learned embeddings)."""
        params = rope_parameters(cfg)
        rotary_dim = rotary_dim_of(self.head_dim, params)
        # new q/k dim j = checkpoint dim qk_permutation[j] within each head (None: as stored)
        self.qk_permutation = partial_rotary_permutation(self.head_dim, rotary_dim, self.rotary_interleaved)
        return get_rotary_embedding(self.head_dim, params["max_model_len"], params)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, H]
        qkv = self.qkv_proj(x)
        if self.fuse_rope_kv and self.attn.can_store_qkv(qkv):
            return self.o_proj(self.fused_attention(positions, qkv, batch))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))

    def fused_attention(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # qkv: [T, (Hq + 2 Hkv) * D] -> [T, Hq * D]
        rope = self.rotary_emb
        assert rope is not None
        if self.use_qk_norm:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        else:
            qw = kw = None
            eps = 0.0
        return self.attn.forward_qkv(qkv, positions, rope.cos_cache, rope.sin_cache, qw, kw, eps, batch)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        inter = cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=bias, ps=ps)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, ps=ps)
        self.act_fn = SiluAndMul()

    @property
    def input_linear(self) -> nn.Module | None:
        """The one consumer of forward's x (LlamaAttention.input_linear's rule)."""
        return self.gate_up_proj if type(self).forward is LlamaMLP.forward else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act_into(self.act_fn, self.down_proj, self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP
    norm_cls: type[nn.Module] = RMSNorm  # built as norm_cls(hidden_size, eps)

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, ps)
        self.mlp = self.mlp_cls(cfg, ps)
        self.input_layernorm = self.norm_cls(cfg.hidden_size, norm_eps(cfg))
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, norm_eps(cfg))

    def norm_input(self, x: torch.Tensor, residual: torch.Tensor | None,
                   linear: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm(x + residual), x + residual): x + residual is the layer's input, the
        previous layer's output not yet added to the stream (the first layer: no residual); the
        normed rows as FP8 where `linear`, their one consumer, takes them (norm_into)."""
        return norm_into(self.input_layernorm, x, residual, linear)

    def forward(self, positions, x, residual, batch):
        x, residual = self.norm_input(x, residual, getattr(self.self_attn, "input_linear", None))
        x = self.self_attn(positions, x, batch)
        plain_mlp = type(self).run_mlp is LlamaDecoderLayer.run_mlp  # (MoE layers route first)
        mlp_linear = getattr(self.mlp, "input_linear", None) if plain_mlp else None
        x, residual = norm_into(self.post_attention_layernorm, x, residual, mlp_linear)
        return self.run_mlp(x, batch), residual

    def run_mlp(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.mlp(x)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg: Any, ps: ParallelState, make_layer: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.ps = ps
        if ps.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps)
        self.layers = make_layers(cfg.num_hidden_layers, ps, make_layer or (lambda i: self.layer_cls(cfg, ps)))
        self.own_layers = owned_layers(self.layers, ps)  # not a ModuleList: no second registration
        if ps.is_last_stage:
            self.norm = self.layer_cls.norm_cls(cfg.hidden_size, norm_eps(cfg))
        # Mistral / Qwen2 / Phi-3 sliding windows, per layer as the config says
        for i, layer in enumerate(self.layers):
            for m in layer.modules():
                if isinstance(m, Attention):
                    m.sliding_window = layer_sliding_window(cfg, i)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> [T, H]
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, batch, intermediate=None):
        # input_ids, positions: [T]; intermediate: the previous stage's (hidden [T, H], residual [T, H])
        if intermediate is None:
            x, residual = self.embed(input_ids, positions), None
        else:
            x, residual = intermediate
        for layer in self.own_layers:
            x, residual = layer(positions, x, residual, batch)
        if not self.ps.is_last_stage:
            return x, residual
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
        self.ps = ps
        self.model = self.build_model(cfg, ps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if ps.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ps, tied=self.tie_word_embeddings)
            if self.tie_word_embeddings and ps.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, cfg: Any, ps: ParallelState) -> nn.Module:
        return self.model_cls(cfg, ps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        # -> hidden states [T, H]; before the last pipeline stage, (hidden [T, H], residual [T, H])
        return self.model(input_ids, positions, batch, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors under Llama's names (a model with other names maps them)."""
        return weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into parameters; returns the names of parameters loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        own = self.model.own_layers
        perm = getattr(own[0].self_attn, "qk_permutation", None) if own else None
        # a last pipeline stage without the embedding loads its tied LM head from it
        tied_head = self.tie_word_embeddings and "lm_head.weight" in params and "model.embed_tokens.weight" not in params
        for name, tensor in self.checkpoint_weights(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if tied_head and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            elif belongs_elsewhere(name, self.ps):
                continue
            if perm is not None and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "q_norm", "k_norm"):
                tensor = permuted_head_rows(tensor, perm)
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
        if self.tie_word_embeddings and "lm_head.weight" in params:
            loaded.add("lm_head.weight")
        return loaded
