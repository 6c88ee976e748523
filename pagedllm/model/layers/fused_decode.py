"""A decode step's Llama-family layer of 4-bit projections without its RMSNorm and SiLU-and-mul
kernels: the GEMVs' own epilogues do their work (kernels/wna16.GemvEpilogue).

At one to GEMV_MAX_ROWS rows each kernel of a layer costs a few microseconds more than its bytes
(launch, ramp, drain); a layer of gemvp projections runs ten kernels: norm, qkv, rotary + store,
attention, its reduce, o, norm, gate/up, activation, down. Here it runs seven:

    qkv       its input is h * gamma from the kernel before, scaled in the epilogue by RMSNorm's
              factor rsqrt(mean(h^2) + eps), read as the column blocks' partial sums of h^2
    o         epilogue: h' = o + residual (the new residual), h' * gamma' (the next norm's input,
              unscaled) and h'^2's partial sums per column block
    gate/up   its input h' * gamma' scaled likewise; epilogue: silu(gate) * up, each program
              owning matching gate and up columns
    down      epilogue as o's, with the next layer's input norm (the last layer: plain, then the
              model's final norm)

Rounding differs from the unfused chain where a norm's factor meets its weight: x * gamma is
rounded to bfloat16 before the product and the factor multiplies the float32 sum after it, where
the norm kernel rounds x * factor then multiplies by gamma; both round each value once at bfloat16.
bfloat16 only (x * gamma unscaled could overflow float16), one rank (o and down would need their
all-reduce before the residual), on CUDA with triton. On by default unless PAGEDLLM_FUSED_GEMV_EPILOGUE=0
(read when a layer is built)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.wna16 import GemvEpilogue


@dataclass
class ScaledRows:
    """RMSNorm(h) not yet formed: rows = h * gamma [T, H] (16-bit) and parts [T, P] the float32
    sums of h^2 over P column blocks, so RMSNorm(h) = rows * rsqrt(sum(parts) / H + eps)."""

    rows: torch.Tensor
    parts: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    def normed(self) -> torch.Tensor:
        """The rows RMSNorm would give (torch): for a consumer that cannot take them scaled."""
        factor = torch.rsqrt(self.parts.sum(1, keepdim=True) / self.rows.shape[1] + self.eps)
        return (self.rows.float() * factor).to(self.rows.dtype)


def _epilogue(linear: nn.Module, x: torch.Tensor, epi: GemvEpilogue):
    return linear.quant_method.apply_epilogue(linear, x, linear.bias, epi)


def takes_rows(layer: nn.Module, x: torch.Tensor | ScaledRows) -> bool:
    """Whether `layer_forward` runs `layer` (its decode_fusable parts, built and loaded) on x."""
    rows = x.rows if isinstance(x, ScaledRows) else x
    qkv = layer.self_attn.qkv_proj
    return layer.decode_fusable and qkv.quant_method.takes_gemv_epilogue(qkv, rows)


def layer_forward(layer: nn.Module, positions: torch.Tensor, x: torch.Tensor | ScaledRows,
                  residual: torch.Tensor | None, batch) -> tuple[torch.Tensor | ScaledRows, torch.Tensor]:
    """LlamaDecoderLayer.forward through the epilogues: (the layer's output, the residual stream),
    the output as ScaledRows of the next layer's input norm where the next layer takes them (then
    the residual already holds it), else the down projection's output (added by the next norm)."""
    attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if isinstance(x, ScaledRows):  # the layer before added its output into residual
        qkv = _epilogue(attn.qkv_proj, x.rows, GemvEpilogue(in_parts=x.parts, eps=x.eps, norm_k=x.rows.shape[1]))[0]
    else:
        x, residual = layer.norm_input(x, residual)
        qkv = attn.qkv_proj(x)
    a = attn.attend(positions, qkv, batch)
    h_in, h, parts = _epilogue(attn.o_proj, a, GemvEpilogue(residual=residual.contiguous(), gamma=post.weight))
    act = _epilogue(mlp.gate_up_proj, h_in, GemvEpilogue(in_parts=parts, eps=post.eps, norm_k=h.shape[1], act=True))[0]
    nxt = layer.next_layer
    if nxt is not None and nxt.decode_fusable:
        norm = nxt.input_layernorm
        rows, h2, parts2 = _epilogue(mlp.down_proj, act, GemvEpilogue(residual=h, gamma=norm.weight))
        return ScaledRows(rows, parts2, norm.eps), h2
    return mlp.down_proj(act), h
