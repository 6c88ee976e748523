"""FP8 (e4m3) weights for the parallel linears, from three sources, in one layout
(pagedllm/kernels/fp8.py: `weight` [N, K] e4m3, `weight_scale` [N, G] float32):

- online (`quantization="fp8"` on a 16/32-bit checkpoint, or dummy weights): the layer loads its
  usual weight, then `process_weights_after_loading` quantizes it with one scale per output
  channel (G = 1);
- `quant_method: fp8` checkpoints (Qwen3-FP8, DeepSeek): e4m3 weights with 128x128 block scales
  `weight_scale_inv` [ceil(N/128), ceil(K/128)] (kept as [N, K/128]: each row its block's scales),
  or one `weight_scale` per tensor;
- compressed-tensors FP8 (compressed_tensors.py): per-channel `weight_scale` [N, 1], per-tensor,
  or block.

Scales are sharded with their weights under tensor parallelism: a column-parallel layer's scales
are rows, narrowed by the layer's own weight loader (so q/k/v and gate/up shards land where their
weights do); a row-parallel layer's K groups are split like its K columns and its rows replicated.
A per-tensor scale of a fused layer becomes the per-channel scale of that shard's rows.
Activations: 16-bit for few rows (W8A16), dynamic per-token FP8 for many (W8A8, `_scaled_mm`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.fp8 import FP8_DTYPE, Fp8Rows, fp8_linear, quantize_fp8_torch, takes_fp8_rows
from pagedllm.model.layers.linear import RowParallelLinear, materialize
from pagedllm.model.layers.quantization.base import LinearMethod, QuantizationConfig, _is_ignored

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = ("online", "block", "channel", "tensor")


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    weight_format: str = "online"  # online | block | channel | tensor
    weight_block: tuple[int, int] | None = None  # (rows, cols) of a scale block, for "block"
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scales
    static_input_scales: bool = False  # the checkpoint carries `input_scale` (read, not used)
    ignored: tuple[str, ...] = ()
    source: str = "online"  # online | fp8 | compressed-tensors

    name = "fp8"

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"fp8 weight format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")

    @classmethod
    def from_hf(cls, qc: dict) -> Fp8Config:
        """A `quant_method: fp8` quantization_config (vLLM's / transformers' FineGrainedFP8)."""
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"model: quantization_config.fmt={fmt!r} is not supported (only e4m3)")
        scheme = str(qc.get("activation_scheme", "dynamic"))
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"model: quantization_config.activation_scheme={scheme!r} must be dynamic or static")
        ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        block = qc.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or any(int(b) <= 0 or int(b) & (int(b) - 1) for b in block):
                raise ValueError(f"model: quantization_config.weight_block_size={block!r} must be two powers of two")
            return cls("block", (int(block[0]), int(block[1])), "weight_scale_inv", scheme == "static", ignored, "fp8")
        return cls("tensor", None, "weight_scale", scheme == "static", ignored, "fp8")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if _is_ignored(prefix, self.ignored):
            return None
        return Fp8LinearMethod(self)

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """Online FP8 quantizes an untied LM head too (per vocabulary row): at batch 1 the head
        is the largest single read of a step (Llama-3.1-8B: 1.05 GB of bf16, 0.25 ms on the
        H200). The embedding stays 16-bit (a row lookup reads next to nothing), so a head tied
        to it stays 16-bit too (an FP8 copy would add memory).
        Pre-quantized checkpoints keep the head they ship (they publish it unquantized)."""
        from pagedllm.model.layers.embedding import ParallelLMHead

        if (self.weight_format != "online" or not isinstance(layer, ParallelLMHead) or layer.tied
                or _is_ignored(prefix, self.ignored)):
            return None
        return Fp8LinearMethod(self)

    def describe(self) -> str:
        scales = {"online": "per-channel", "channel": "per-channel", "tensor": "per-tensor",
                  "block": f"{self.weight_block[0]}x{self.weight_block[1]} block" if self.weight_block else "block"}
        return f"fp8 e4m3 ({scales[self.weight_format]} scales, {self.source})"


class _RowBroadcast:
    """A per-tensor scale seen by a column-parallel weight loader as a column of rows: any
    `narrow(0, start, n)` is that value n times ([n, 1])."""

    shape = torch.Size([1 << 62, 1])

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value.reshape(1, 1).float()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        assert dim == 0
        return self.value.expand(length, 1)


def _out_rows(layer: nn.Module) -> int:
    return layer.weight.shape[0]


class Fp8LinearMethod(LinearMethod):
    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    # ---- parameters --------------------------------------------------------------------
    def create_weights(self, layer: nn.Module) -> None:
        cfg = self.config
        if cfg.weight_format == "online":
            return  # the layer loads its 16/32-bit weight; quantized after loading
        old = layer.weight
        n, k = old.shape
        weight = nn.Parameter(torch.empty((n, k), dtype=FP8_DTYPE, device=old.device), requires_grad=False)
        weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
        layer.weight = weight
        row_parallel = isinstance(layer, RowParallelLinear)
        if cfg.weight_format == "block":
            bn, bk = cfg.weight_block
            if row_parallel and k % bk:
                raise ValueError(
                    f"tensor_parallel_size={layer.ps.tp_size} splits {layer.__class__.__name__}'s input "
                    f"into {k} columns, not a multiple of the checkpoint's {bk}-wide scale blocks")
            groups = -(-k // bk)
        else:
            groups = 1
        scale = nn.Parameter(torch.empty((n, groups), dtype=torch.float32, device=old.device), requires_grad=False)
        scale.weight_loader = self._scale_loader(layer)  # type: ignore[attr-defined]
        layer.register_parameter(cfg.scale_name, scale)
        if cfg.static_input_scales:
            s = nn.Parameter(torch.zeros((), dtype=torch.float32, device=old.device), requires_grad=False)
            s.weight_loader = _max_loader  # type: ignore[attr-defined]
            layer.input_scale = s

    def _scale_loader(self, layer: nn.Module):
        cfg = self.config
        row_parallel = isinstance(layer, RowParallelLinear)

        def load(param: nn.Parameter, loaded, shard_id=None) -> None:
            if cfg.weight_format == "tensor":
                value = materialize(loaded).reshape(-1)
                if value.numel() != 1:
                    raise ValueError(f"per-tensor {cfg.scale_name} must hold one value, got shape {tuple(value.shape)}")
                if row_parallel:
                    param.data.copy_(value.float().expand_as(param))
                else:
                    layer.weight_loader(param, _RowBroadcast(value), shard_id)
                return
            scale = materialize(loaded).float()
            if cfg.weight_format == "channel":
                scale = scale.reshape(-1, 1)
            else:  # block: one row per block of rows in the checkpoint -> one per weight row
                scale = scale.repeat_interleave(cfg.weight_block[0], dim=0)
            if row_parallel:
                groups = param.shape[1]
                if cfg.weight_format == "block":
                    scale = scale.narrow(1, layer.ps.tp_rank * groups, groups)
                rows = param.shape[0]
                if scale.shape[0] < rows or scale.shape[1] != groups:
                    raise ValueError(f"{cfg.scale_name} shape mismatch: parameter {tuple(param.shape)}, "
                                     f"checkpoint {tuple(materialize(loaded).shape)}")
                param.data.copy_(scale[:rows])
            else:
                layer.weight_loader(param, scale, shard_id)

        return load

    # ---- after loading -----------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cfg = self.config
        if cfg.weight_format == "online":
            q, s = quantize_fp8_torch(layer.weight.data)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(s, requires_grad=False)
            return
        if cfg.scale_name != "weight_scale":
            layer.weight_scale = nn.Parameter(getattr(layer, cfg.scale_name).data.contiguous(), requires_grad=False)
            delattr(layer, cfg.scale_name)
        if not layer.weight.is_contiguous():
            layer.weight = nn.Parameter(layer.weight.data.contiguous(), requires_grad=False)

    def takes_fp8_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return takes_fp8_rows(x, layer.weight_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def describe(self) -> str:
        return self.config.describe()


def _max_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Static activation scales of a fused layer's parts: kept as their maximum (activations
    are quantized dynamically per token here, which is at least as accurate)."""
    value = materialize(loaded).float().max()
    param.data.copy_(torch.maximum(param.data, value))
