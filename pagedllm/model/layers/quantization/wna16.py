"""Integer weight-only linears (W4A16 / W8A16) from GPTQ, AWQ (GEMM packing) and
compressed-tensors `pack-quantized` checkpoints, or quantized at load (dummy weights). Every
source is repacked after loading into the kernels' one layout (pagedllm/kernels/wna16.py).

What each checkpoint stores for a linear of N outputs and K inputs, G = K / group_size groups,
P = 32 / bits values per int32 word, value i of a word at bits bits * i:

    gptq   qweight [K/P, N] packed along K; qzeros [G, N/P] packed along N, stored as zero - 1
           (the original format; `checkpoint_format: gptq_v2` stores the zero itself);
           scales [G, N]; g_idx [K] (the group of each input: k // group_size, or any order
           with desc_act)
    awq    qweight [K, N/8] and qzeros [G, N/8] packed along N in the order 0 2 4 6 1 3 5 7
           (value i of a word is column 8c + order[i]); scales [G, N]
    compressed-tensors  weight_packed [N, K/P] packed along K, values offset by 2**(bits-1);
           weight_scale [N, G]; weight_zero_point [N/P, G] packed along N (asymmetric only);
           weight_shape [2]; weight_g_idx [K] (actorder)

Tensor parallelism: a column-parallel layer takes its outputs' columns of every tensor (through
the layer's own weight loader on a transposed / packed view, so q/k/v and gate/up shards land
where the plain weight's would); a row-parallel layer takes its K rows and its groups (K per
rank must be a multiple of the group size), except with desc_act, where every rank keeps all
groups and its part of g_idx says which each input uses, and per channel, where every rank
keeps the one group's scales.

With PAGEDLLM_WNA16_SWAP=1 (off by default: it loses at one row, kernels/wna16.py), 4-bit layers are stored instead in
the N-major layout of the swap-AB tensor-core kernel (kernels/wna16.py), converted last, from the
rank's own (already sharded, already act-order sorted) weights; 8-bit layers keep the K-packed one.

Act-order (a g_idx that is not k // group_size): inputs are sorted by group and each group's run
padded to group_size with inputs fed by a zero column, so the kernels see plain groups; `perm`
gathers the activations into that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.wna16 import (
    kperm_applies,
    kperm_enabled,
    kperm_pack,
    pack_factor,
    pack_rows,
    quantize_wna16_torch,
    swap_enabled,
    to_int4_nk,
    unpack_rows,
    wna16_int4_nk_linear,
    wna16_linear,
)
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    materialize,
)
from pagedllm.model.layers.quantization.base import LinearMethod, QuantizationConfig, _is_ignored

FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors", "online")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class WNA16Config(QuantizationConfig):
    fmt: str = "online"
    bits: int = 4
    group_size: int | None = 128  # None: one group per output channel
    symmetric: bool = True
    desc_act: bool = False
    ignored: tuple[str, ...] = ()
    name: str = "gptq"  # what --quantization names it

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"weight-only format must be one of {FORMATS}, got {self.fmt!r}")
        pack_factor(self.bits)
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % pack_factor(self.bits)):
            raise ValueError(f"model: quantization group_size={self.group_size} must be a positive multiple "
                             f"of {pack_factor(self.bits)} (or -1)")

    @classmethod
    def from_gptq(cls, qc: dict) -> WNA16Config:
        """A `quant_method: gptq` quantization_config (AutoGPTQ / GPTQModel / optimum)."""
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq")
        _check("checkpoint_format", fmt, ("gptq", "gptq_v2"))
        bits = int(qc.get("bits", 4))
        _check("bits", bits, (4, 8))
        return cls(fmt, bits, _group(qc.get("group_size", 128)), bool(qc.get("sym", True)),
                   bool(qc.get("desc_act", False)), _ignored(qc), "gptq")

    @classmethod
    def from_awq(cls, qc: dict) -> WNA16Config:
        """A `quant_method: awq` quantization_config (AutoAWQ, GEMM packing)."""
        _check("version", str(qc.get("version", "gemm")).lower(), ("gemm",))
        _check("bits", int(qc.get("bits", qc.get("w_bit", 4))), (4,))
        group = _group(qc.get("group_size", qc.get("q_group_size", 128)))
        return cls("awq", 4, group, not bool(qc.get("zero_point", True)), False, _ignored(qc), "awq")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if _is_ignored(prefix, self.ignored):
            return None
        return WNA16LinearMethod(self)

    def describe(self) -> str:
        groups = "per-channel" if self.group_size is None else f"group {self.group_size}"
        sym = "symmetric" if self.symmetric else "asymmetric"
        act = ", act-order" if self.desc_act else ""
        src = "quantized at load" if self.fmt == "online" else self.fmt
        return f"int{self.bits} weight-only ({groups}, {sym}{act}; {src})"


def _check(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"model: quantization_config.{field}={value!r} is not supported "
                         f"(supported: {', '.join(repr(a) for a in allowed)})")


def _group(value) -> int | None:
    g = int(value)
    return None if g == -1 else g


def _ignored(qc: dict) -> tuple[str, ...]:
    return tuple(qc.get("modules_to_not_convert") or qc.get("ignore") or ())


class _Transposed:
    """A tensor (or lazy checkpoint slice) whose output dimension is `out_dim` (packed by
    `factor` there), seen by a column-parallel weight loader as rows: `narrow(0, s, n)` takes
    outputs s .. s+n of the underlying tensor in its own layout."""

    def __init__(self, t, out_dim: int, factor: int = 1) -> None:
        self.t, self.out_dim, self.factor = t, out_dim, factor
        self.shape = torch.Size([t.shape[out_dim] * factor])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        assert dim == 0
        f = self.factor
        if start % f or length % f:
            raise ValueError(f"outputs [{start}, {start + length}) do not align with {f}-value packed words")
        return self.t.narrow(self.out_dim, start // f, length // f)


class _ParamView:
    def __init__(self, param: torch.Tensor, out_dim: int, factor: int) -> None:
        self.data = _Transposed(param, out_dim, factor)


# per format: checkpoint tensor -> (output dim, its pack factor there, input dim, what the
# input dim counts: "k" inputs, "kp" packed inputs, "g" groups)
def _layout(cfg: WNA16Config) -> dict[str, tuple[int | None, int, int | None, str]]:
    p = pack_factor(cfg.bits)
    if cfg.fmt in ("gptq", "gptq_v2"):
        return {"qweight": (1, 1, 0, "kp"), "qzeros": (1, p, 0, "g"), "scales": (1, 1, 0, "g"), "g_idx": (None, 1, 0, "k")}
    if cfg.fmt == "awq":
        out = {"qweight": (1, 8, 0, "k"), "scales": (1, 1, 0, "g")}
        if not cfg.symmetric:
            out["qzeros"] = (1, 8, 0, "g")
        return out
    out = {"weight_packed": (0, 1, 1, "kp"), "weight_scale": (0, 1, 1, "g"), "weight_shape": (None, 1, None, "")}
    if not cfg.symmetric:
        out["weight_zero_point"] = (0, p, 1, "g")
    if cfg.desc_act:
        out["weight_g_idx"] = (None, 1, 0, "k")
    return out


class WNA16LinearMethod(LinearMethod):
    def __init__(self, config: WNA16Config) -> None:
        self.config = config
        self.int4_nk = False  # the weights in the swap-AB kernel's layout (set after loading)

    # ---- parameters --------------------------------------------------------------------
    def create_weights(self, layer: nn.Module) -> None:
        cfg = self.config
        layer.kperm = False  # the steps-permuted layout (decided after loading, `_set`)
        if cfg.fmt == "online":
            return  # the layer loads (or draws) its 16-bit weight; quantized after loading
        n, k = layer.weight.shape
        device = layer.weight.device
        scale_dtype = layer.weight.dtype
        del layer.weight
        p = pack_factor(cfg.bits)
        row_parallel = isinstance(layer, RowParallelLinear)
        gs = k if cfg.group_size is None else cfg.group_size
        if k % p or (k % gs and not (cfg.desc_act and row_parallel)):
            raise ValueError(f"{layer.__class__.__name__}'s {k} inputs per rank (tensor_parallel_size="
                             f"{layer.ps.tp_size}) do not split into the checkpoint's groups of {gs}")
        full_k = k * layer.ps.tp_size if row_parallel else k
        # a row-parallel act-order layer keeps every group (its inputs may use any of them)
        g = (full_k if cfg.desc_act and row_parallel else k) // gs if cfg.group_size is not None else 1
        sizes = {"k": k, "kp": k // p, "g": g}
        for name, (out_dim, factor, in_dim, unit) in _layout(cfg).items():
            if name == "weight_shape":
                shape, dtype = (2,), torch.int64
            elif out_dim is None:
                shape, dtype = (sizes[unit],), torch.int32
            else:
                dims = [0, 0]
                dims[out_dim] = n // factor
                dims[in_dim] = sizes[unit]
                shape = tuple(dims)
                dtype = scale_dtype if name in ("scales", "weight_scale") else torch.int32
            param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
            param.weight_loader = self._loader(layer, name, full_k)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)

    def _loader(self, layer: nn.Module, name: str, full_k: int):
        cfg = self.config
        out_dim, factor, in_dim, unit = _layout(cfg)[name]
        row_parallel = isinstance(layer, RowParallelLinear)
        fused = isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear))

        def load(param: nn.Parameter, loaded, shard_id=None) -> None:
            if name == "weight_shape":
                shape = [int(v) for v in materialize(loaded).reshape(-1)]
                if len(shape) != 2 or shape[1] != full_k:
                    raise ValueError(f"weight_shape {shape} does not match the layer's {full_k} inputs")
                param.data.copy_(torch.tensor(shape))
                return
            if out_dim is None:  # g_idx: the rank's inputs of a row-parallel layer, else all
                src = loaded.narrow(0, layer.ps.tp_rank * param.shape[0], param.shape[0]) if row_parallel else materialize(loaded)
                src = src.to(device=param.device, dtype=param.dtype)  # (a CUDA parameter, a checkpoint's CPU tensor)
                if getattr(param, "loaded_once", False) and not torch.equal(param.data, src):
                    raise ValueError(f"{name} differs between the parts of a fused layer (shard {shard_id!r})")
                param.data.copy_(src)
                param.loaded_once = True  # type: ignore[attr-defined]
                return
            if row_parallel:
                n_in = param.shape[in_dim]
                # act-order: every rank keeps all groups; per channel: the one group spans all ranks
                keep_all = unit == "g" and (cfg.desc_act or cfg.group_size is None)
                src = loaded if keep_all else loaded.narrow(in_dim, layer.ps.tp_rank * n_in, n_in)
                src = materialize(src)
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"{name} shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(src.shape)}")
                param.data.copy_(src)
            elif fused:
                layer.weight_loader(_ParamView(param.data, out_dim, factor), _Transposed(loaded, out_dim, factor), shard_id)
            else:
                n = param.shape[out_dim] * factor
                src = _Transposed(loaded, out_dim, factor).narrow(0, layer.ps.tp_rank * n, n)
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(f"{name} shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(src.shape)}")
                param.data.copy_(src)

        return load

    # ---- after loading -----------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cfg = self.config
        bits = cfg.bits
        if cfg.fmt == "online":
            w = layer.weight.data
            qweight, scales, zeros = quantize_wna16_torch(w, bits, cfg.group_size, cfg.symmetric)
            del layer.weight
            self._set(layer, qweight, scales, zeros, None)
            return
        q, scales, zeros, g_idx = self._unpacked(layer)  # [K, N] ints, [G, N], [G, N] or None, [K] or None
        for name in _layout(cfg):
            delattr(layer, name)
        perm = None
        k = q.shape[0]
        gk = k if cfg.group_size is None else cfg.group_size
        if g_idx is not None and not torch.equal(g_idx, torch.arange(k, device=q.device) // gk):
            q, scales, zeros, perm = _sort_groups(q, scales, zeros, g_idx.long(), gk)
        if zeros is not None and bool((zeros == (1 << (bits - 1))).all()):
            zeros = None  # a symmetric checkpoint that stores its zeros
        self._set(layer, pack_rows(q, bits), scales, zeros, perm)

    def _unpacked(self, layer: nn.Module):
        cfg = self.config
        bits = cfg.bits
        if cfg.fmt == "compressed-tensors":
            q = unpack_rows(layer.weight_packed.data.t().contiguous(), bits)
            scales = layer.weight_scale.data.t().contiguous()
            zeros = None
            if not cfg.symmetric:
                zeros = unpack_rows(layer.weight_zero_point.data, bits).t()
            g_idx = layer.weight_g_idx.data if cfg.desc_act else None
        elif cfg.fmt == "awq":
            q = _unpack_cols(layer.qweight.data, bits, AWQ_ORDER)
            scales = layer.scales.data
            zeros = None if cfg.symmetric else _unpack_cols(layer.qzeros.data, bits, AWQ_ORDER)
            g_idx = None
        else:
            q = unpack_rows(layer.qweight.data, bits)
            scales = layer.scales.data
            zeros = _unpack_cols(layer.qzeros.data, bits) + (1 if cfg.fmt == "gptq" else 0)
            g_idx = layer.g_idx.data if cfg.desc_act else None  # otherwise k // group_size
        zeros = None if zeros is None else zeros.to(scales.dtype).contiguous()
        return q, scales.contiguous(), zeros, g_idx

    def _set(self, layer: nn.Module, qweight, scales, zeros, perm) -> None:
        self.int4_nk = self.config.bits == 4 and swap_enabled()
        k = int(qweight.shape[0]) * pack_factor(self.config.bits)
        groups = int(scales.shape[0])
        group_k = 0 if groups == 1 else k // groups
        # the steps-permuted layout, per layer: its K and groups must be whole steps
        layer.kperm = (self.config.bits == 4 and not self.int4_nk and kperm_enabled() and group_k * groups in (0, k)
                       and kperm_applies(k, group_k))
        if self.int4_nk:
            qweight, scales, zeros = to_int4_nk(qweight, scales, zeros)
        elif layer.kperm:
            qweight = kperm_pack(qweight)
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        layer.zeros = None if zeros is None else nn.Parameter(zeros.contiguous(), requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.perm is not None:
            if int(layer.perm.shape[0]) != x.shape[1]:  # padded groups read a zero column
                x = torch.nn.functional.pad(x, (0, 1))
            x = x.index_select(1, layer.perm)
        if self.int4_nk:
            return wna16_int4_nk_linear(x, layer.qweight, layer.scales, layer.zeros, bias)
        return wna16_linear(x, layer.qweight, layer.scales, layer.zeros, self.config.bits, bias, layer.kperm)

    def describe(self) -> str:
        return self.config.describe()


def _unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C/P] int32 packed along columns -> [R, C] values; `order`: value i of a word is
    column P*c + order[i] (AWQ), else column P*c + i."""
    vals = unpack_rows(packed.t().contiguous(), bits).t()  # [R, C], column P*c + i = value i
    if order is not None:
        p = len(order)
        inverse = torch.tensor([order.index(c) for c in range(p)], device=packed.device)
        r, c = vals.shape
        vals = vals.reshape(r, c // p, p).index_select(2, inverse).reshape(r, c)
    return vals.contiguous()


def _sort_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor, gk: int):
    """Act-order to plain groups: inputs sorted by group, each used group a run of gk inputs
    (padded with the index K: the zero column `apply` appends). Returns (q [K', N], scales,
    zeros, perm [K'])."""
    k, n = q.shape
    used, counts = torch.unique(g_idx, return_counts=True)
    if int(counts.max()) > gk:
        raise ValueError(f"g_idx puts {int(counts.max())} inputs in one group, more than group_size={gk}")
    order = torch.argsort(g_idx, stable=True)
    slot_of_group = torch.full((scales.shape[0],), -1, dtype=torch.long, device=q.device)
    slot_of_group[used] = torch.arange(used.numel(), device=q.device)
    rank_in_group = torch.arange(k, device=q.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    dest = slot_of_group[g_idx[order]] * gk + rank_in_group
    perm = torch.full((used.numel() * gk,), k, dtype=torch.long, device=q.device)
    perm[dest] = order
    q_new = torch.zeros((used.numel() * gk, n), dtype=q.dtype, device=q.device)
    q_new[dest] = q[order]
    return q_new, scales[used], None if zeros is None else zeros[used], perm
