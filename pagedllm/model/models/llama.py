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
from pagedllm.kernels import small_m
from pagedllm.kernels._triton import fusion_enabled
from pagedllm.kernels.qkv_rope import qkv_gemm_rope_applies
from pagedllm.model.layers.activation import SiluAndMul
from pagedllm.model.layers.attention import Attention, layer_sliding_window
from pagedllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model.layers.layernorm import RMSNorm
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
    stream_linear,
)
from pagedllm.model.layers.partial_rotary import partial_rotary_permutation, permuted_head_rows
from pagedllm.model.layers.pipeline import belongs_elsewhere, make_layers, owned_layers
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
        # PAGEDLLM_FUSED_QKV_GEMM=1: in forward_stream, the rope/store in the qkv product's epilogue
        self.fuse_qkv_gemm = fusion_enabled("QKV_GEMM", default=False)

    @property
    def fuse_rope_kv(self) -> bool:
        """[q/k norm +] rotary + store-KV in one kernel on the GPU (PAGEDLLM_FUSED_ROPE_KV=0: off), for
        the plain rotary and RMSNorm only (no rotary, or Gemma 3's (1 + w) norm, which a
        subclass sets after this class's __init__: the unfused path)."""
        return (self.fuse_rope_kv_requested and type(self.rotary_emb) is RotaryEmbedding
                and (not self.use_qk_norm or type(self.q_norm) is type(self.k_norm) is RMSNorm))

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
        return self.o_proj(self.attend(positions, self.qkv_proj(x), batch))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # qkv: [T, (Hq + 2 Hkv) * D] -> the attention's output [T, Hq * D], before o_proj
        if self.fuse_rope_kv and self.attn.can_store_qkv(qkv):
            return self.fused_attention(positions, qkv, batch)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, batch)

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q_norm weight, k_norm weight, eps) for the fused kernels; (None, None, 0.0) without."""
        if self.use_qk_norm:
            return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return None, None, 0.0

    def fused_attention(self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # qkv: [T, (Hq + 2 Hkv) * D] -> [T, Hq * D]
        rope = self.rotary_emb
        assert rope is not None
        return self.attn.forward_qkv(qkv, positions, rope.cos_cache, rope.sin_cache, *self.qk_norms(), batch)

    def attend_stream(self, positions: torch.Tensor, s: torch.Tensor, norm: nn.Module,
                      batch: ForwardBatch) -> torch.Tensor:
        """attend(positions, qkv_proj(norm(s)), batch) for forward_stream: the norm folded into the
        qkv product; with PAGEDLLM_FUSED_QKV_GEMM=1, where it applies, also the q/k norm + rotary +
        store in the product's epilogue (kernels/qkv_gemm_rope_triton.py: no kernel between the
        product and attention)."""
        proj, rope = self.qkv_proj, self.rotary_emb
        if (self.fuse_qkv_gemm and self.fuse_rope_kv and self.attn.can_store_qkv(s) and rope is not None
                and proj.quant_method is None and proj.small_m_gemm
                and small_m.norm_fusable(s, norm.weight)
                and qkv_gemm_rope_applies(s, proj.weight, self.head_dim, rope.cos_cache.shape[-1])):
            return self.attn.forward_qkv_gemm(s, proj.weight, proj.bias, (norm.weight, norm.eps), positions,
                                              rope.cos_cache, rope.sin_cache, *self.qk_norms(), batch)
        return self.attend(positions, stream_linear(proj, s, norm=norm), batch)


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

    def forward_stream(self, s: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """s + forward(norm(s)): the norm folded into gate_up's product, the add into down's."""
        return stream_linear(self.down_proj, self.act_fn(stream_linear(self.gate_up_proj, s, norm=norm)), residual=s)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls: type[nn.Module] = LlamaMLP
    norm_cls: type[nn.Module] = RMSNorm  # built as norm_cls(hidden_size, eps)

    # PAGEDLLM_FUSED_NORM=1: forward_stream where it applies (read when a layer is built)
    fuse_norm_requested = False

    def __init__(self, cfg: Any, ps: ParallelState):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, ps)
        self.mlp = self.mlp_cls(cfg, ps)
        self.input_layernorm = self.norm_cls(cfg.hidden_size, norm_eps(cfg))
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, norm_eps(cfg))
        self.fuse_norm_requested = fusion_enabled("NORM", default=False)
        self.ps = ps

    def norm_input(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_layernorm(x + residual), x + residual): x + residual is the layer's input, the
        previous layer's output not yet added to the stream (the first layer: no residual)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm(x, residual)

    def forward(self, positions, x, residual, batch):
        if residual is None and self.stream_applies(x):
            return self.forward_stream(positions, x, batch), None
        x, residual = self.norm_input(x, residual)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.run_mlp(x, batch), residual

    def run_mlp(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.mlp(x)

    # ---- the residual stream kept whole (PAGEDLLM_FUSED_NORM=1) ---------------------------
    # A decode batch of 1-16 tokens on CUDA spends most of a layer's time between its short
    # kernels, and two of them are RMSNorms. Here the layer takes the stream s = x + residual and
    # returns the next one: each RMSNorm is folded into the products that read it (qkv, gate_up
    # or the MoE router and gate/up kernels), each residual add into the product that ends its
    # half (o, down): no norm kernels at all. The layer after it then gets (s, None), as the
    # first layer gets the embeddings, and the final norm normalizes s.
    def stream_applies(self, x: torch.Tensor) -> bool:
        """Whether forward_stream runs for x: stream_layer_ok, and a 16-bit CUDA decode batch of
        at most small_m.MAX_ROWS rows (where the products are the swap-AB kernel's)."""
        return (self.stream_layer_ok() and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
                and 0 < x.shape[0] <= small_m.MAX_ROWS)

    def stream_layer_ok(self) -> bool:
        """Switched on (PAGEDLLM_FUSED_NORM=1), one rank and one stage, and this class's own norms,
        attention and MLP (a subclass that changes one of them keeps the plain path). Decided once."""
        ok = getattr(self, "_stream_ok", None)
        if ok is None:
            ok = self._stream_ok = bool(
                self.fuse_norm_requested
                and self.ps.tp_size == 1 and self.ps.pp_size == 1
                and type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm
                and type(self).norm_input is LlamaDecoderLayer.norm_input
                and type(self.self_attn).forward is LlamaAttention.forward
                and self.stream_mlp_ok(self.mlp)
            )
        return ok

    def stream_mlp_ok(self, mlp: nn.Module) -> bool:
        return type(mlp).forward is LlamaMLP.forward and type(self).run_mlp is LlamaDecoderLayer.run_mlp

    def forward_stream(self, positions: torch.Tensor, s: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        attn = self.self_attn
        s = stream_linear(attn.o_proj, attn.attend_stream(positions, s, self.input_layernorm, batch), residual=s)
        return self.run_mlp_stream(s, batch)

    def run_mlp_stream(self, s: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.mlp.forward_stream(s, self.post_attention_layernorm)


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
        if residual is None:  # the layers kept the stream whole (forward_stream)
            return self.norm(x)
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
