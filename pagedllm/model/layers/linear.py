"""Linear layers written for tensor parallelism, plain at world size 1.

Column-parallel splits the output features across ranks; row-parallel splits the input
features and all-reduces the partial sums. Weights are [out_features, in_features] like
nn.Linear. Every parameter carries a `weight_loader(param, loaded, shard_id)` that copies the
rank's slice of a checkpoint tensor into place, so fused layers (qkv, gate_up) load from the
separate checkpoint tensors.

`loaded` is a torch.Tensor or a lazy checkpoint slice (model/loader.py `CheckpointSlice`):
loaders only call `.shape` and `.narrow(dim, start, length)` on it, and `materialize()` where
a parameter is replicated, so a rank reads just its own part of the checkpoint.

How q/k/v heads land on ranks (4 q heads, 2 kv heads):

    tp=2:  rank 0: q0 q1 | k0 | v0        rank 1: q2 q3 | k1 | v1
    tp=4:  rank r: q_r   | k_{r//2} | v_{r//2}    (each kv head replicated on 2 ranks)
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import SINGLE, ParallelState, check_tp_divides, kv_heads_per_rank
from pagedllm.kernels import cpu_gemm, small_m
from pagedllm.kernels.fp8 import Fp8Rows


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def materialize(loaded) -> torch.Tensor:
    """The whole checkpoint tensor (reads a lazy slice in full)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.load()


def copy_checked(dst, src, what: str = "weight") -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what} shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    # a tensor parameter takes a lazy part (a quantized GGUF tensor) dequantized; a quantized
    # layer's stand-in (quantization/gguf.py) records it as it is
    dst.copy_(materialize(src) if isinstance(dst, torch.Tensor) else src)


def dense_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An unquantized layer's product: the swap-AB kernel for a CUDA decode batch of at most 16
    rows when the layer was built with PAGEDLLM_SMALL_M_GEMM on (kernels/small_m.py) and its table
    does not prefer cuBLAS for the shape; else `F.linear` (MKL's packed weight on the CPU)."""
    if layer.small_m_gemm:
        config = small_m.pick(x, layer.weight)
        if config is not None:
            return small_m.small_m_linear(x, layer.weight, bias, config=config)
    return cpu_gemm.linear(x, layer.weight, bias, layer.packed_weight)


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """A replicated parameter: every rank holds the whole tensor."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(materialize(loaded))


class LinearBase(nn.Module):
    """What column- and row-parallel layers share: the attributes set at build / load, and whether
    the layer takes FP8 rows."""

    # MKL-packed copy of the weight for small CPU products (kernels/cpu_gemm.py), set after loading
    packed_weight: cpu_gemm.PackedWeight | None = None
    # a quantized layout and product (model/layers/quantization), given at load; None: plain
    quant_method = None
    # 16-bit products of 1-16 rows on CUDA through kernels/small_m.py (PAGEDLLM_SMALL_M_GEMM), set at build
    small_m_gemm = False

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether forward would quantize activations like x ([T, ...] rows of its dtype and device)
        per token to FP8, and so takes them as kernels/fp8.Fp8Rows made by the kernel before."""
        return self.quant_method is not None and self.quant_method.takes_fp8_rows(self, x)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, ps: ParallelState = SINGLE,
                 skip_bias_add: bool = False):
        super().__init__()
        # skip_bias_add: forward leaves the bias out, for the caller to fuse it into what follows
        self.skip_bias_add = skip_bias_add
        self.small_m_gemm = small_m.enabled("linear")
        if out_features % ps.tp_size:
            raise ValueError(f"{out_features} output features do not split over tp_size={ps.tp_size}")
        self.ps = ps
        self.in_features = in_features
        self.out_per_rank = out_features // ps.tp_size
        self.weight = _set_loader(nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False), self.weight_loader)
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False), self.weight_loader)
            if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = self.out_per_rank
        copy_checked(param.data, loaded.narrow(0, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        # x: [T, in] (or those rows as FP8, when takes_fp8_rows) -> [T, out / tp]
        bias = None if self.skip_bias_add else self.bias
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return dense_linear(self, x, bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up projections); each
    rank holds its slice of every output, side by side: [gate_r | up_r]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, ps: ParallelState = SINGLE):
        for size in output_sizes:
            if size % ps.tp_size:
                raise ValueError(f"output size {size} does not split over tp_size={ps.tp_size}")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, ps)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        tp = self.ps.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.ps.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix; heads are split across ranks (kv heads are
    replicated when there are fewer of them than ranks). A rank's output: [q_r | k_r | v_r]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, ps: ParallelState = SINGLE):
        tp = ps.tp_size
        check_tp_divides(tp, num_heads, num_kv_heads)
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, ps)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        d = self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        # the rank's block of heads in the checkpoint tensor; replicas of a kv head share one
        block = self.ps.tp_rank if shard_id == "q" else self.ps.tp_rank // self.kv_replicas
        copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, block * size, size), f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, ps: ParallelState = SINGLE):
        super().__init__()
        if in_features % ps.tp_size:
            raise ValueError(f"{in_features} input features do not split over tp_size={ps.tp_size}")
        self.ps = ps
        self.small_m_gemm = small_m.enabled("linear")
        self.in_per_rank = in_features // ps.tp_size
        self.weight = _set_loader(nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False), self.weight_loader)
        # the bias is added once, after the all-reduce, so every rank holds all of it
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(out_features), requires_grad=False), default_weight_loader)
            if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = self.in_per_rank
        copy_checked(param.data, loaded.narrow(1, self.ps.tp_rank * n, n))

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        # x: [T, in / tp] (or those rows as FP8, when takes_fp8_rows) -> partial sums [T, out]
        # -> all-reduced [T, out]
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, None)
        else:
            y = dense_linear(self, x, None)
        y = self.ps.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
