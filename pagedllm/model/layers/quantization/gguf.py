"""GGUF weights executed quantized on the CPU (`quantization="gguf"`, the default for a .gguf
model on the CPU; `quantization="none"` dequantizes them to float32 at load instead).

The linears, the embedding and the LM head keep the file's blocks (Q4_0, Q4_1, Q8_0, Q4_K,
Q5_K, Q6_K; kernels/gguf_kernels.py) as uint8 parameters [rows, row_bytes]. Q4_0, Q4_1 and
Q8_0 multiply through the int8-activation C kernel up to INT8_PREFILL_ROWS rows (the
activations quantized to int8 in blocks of 32 per call, two passes by default, integer dot
products; see kernels/gguf_kernels.py and benchmarks/RESULTS.md); `PAGEDLLM_GGUF_INT8=0` keeps
them float32 like the K-quants, which multiply through the float-activation C kernel up to
PREFILL_ROWS rows; from there (prefill) the weight is dequantized for the call and multiplied by
MKL (faster for many rows, and the dequantize is small beside the product). The embedding
looks its rows up by dequantizing just them; a tied LM head (SmolLM2) multiplies by the same
blocks, so the vocabulary is stored once, quantized.

Loading: the loader hands the layers `GGUFTensor`s (quantized, not dequantized). A layer's own
weight loader still does the placing (q/k/v and gate/up rows, this rank's shard): it narrows a
`_Recorder` standing in for the weight, which records each part. After loading, the parts
become segments: runs of rows of one type, each one parameter (`weight`, then `weight_1`, ...),
multiplied into its columns of the output. A part that is not one of the six types (Q5_0,
Q2_K, IQ*, F16, F32) is dequantized to a float32 segment; so is a row-parallel shard whose
columns do not fall on whole blocks (tensor parallelism splitting a 256-wide K block).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_gemm, gguf_kernels
from pagedllm.model.layers.quantization.base import LinearMethod, QuantizationConfig

logger = logging.getLogger(__name__)

# products of more rows than this dequantize the weight and use MKL (benchmarks/RESULTS.md):
# float-activation ones, and int8 ones (Q4_0 / Q4_1 / Q8_0; even with MKL at 512 rows, slower
# at 2048)
PREFILL_ROWS = 64
INT8_PREFILL_ROWS = 512


class GGUFTensor:
    """A quantized GGUF tensor as the weight loaders see a checkpoint tensor: `.shape` (the
    float [rows, K] it stands for), `.narrow` (rows; or columns, on whole blocks: else the
    dequantized part), `.load()` (dequantized float32), and its blocks `raw` (uint8 numpy
    [rows, row_bytes], possibly a view of the file's memory map)."""

    __slots__ = ("name", "qtype", "raw", "shape")

    def __init__(self, name: str, qtype: str, raw: np.ndarray, k: int) -> None:
        self.name, self.qtype, self.raw = name, qtype, raw
        self.shape = torch.Size([raw.shape[0], k])

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int):
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"{self.name}: [{start}, {start + length}) of dim {dim} is outside its size {size}")
        if dim == 0:
            return GGUFTensor(self.name, self.qtype, self.raw[start:start + length], self.shape[1])
        _, block, nbytes = gguf_kernels.QUANT_TYPES[self.qtype]
        if start % block or length % block:
            logger.info("%s: columns [%d, %d) split %s blocks of %d; that shard is dequantized", self.name, start,
                        start + length, self.qtype, block)
            return self.load().narrow(1, start, length)
        return GGUFTensor(self.name, self.qtype, self.raw[:, start // block * nbytes:(start + length) // block * nbytes],
                          length)

    def permute_rows(self, index: np.ndarray) -> GGUFTensor:
        return GGUFTensor(self.name, self.qtype, self.raw[index], self.shape[1])

    def blocks(self) -> torch.Tensor:
        """The blocks as an owned uint8 tensor (a copy: never the file's memory map)."""
        return torch.from_numpy(np.array(self.raw, dtype=np.uint8, copy=True))

    def load(self) -> torch.Tensor:
        kern = gguf_kernels.kernels()
        w = self.blocks()
        if kern is None:
            return gguf_kernels.dequantize_reference(w, self.qtype, self.shape[1])
        return kern.dequantize(w, self.qtype, self.shape[1])


class _Recorder:
    """Stands in for a layer's weight while the checkpoint loads: the layer's weight loader
    narrows it to where a part goes and `copy_`s the part, which is recorded with its first
    row."""

    def __init__(self, rows: int, k: int, parts: list, offset: int = 0) -> None:
        self.shape = torch.Size([rows, k])
        self._parts, self._offset = parts, offset

    @property
    def data(self) -> _Recorder:
        return self

    def narrow(self, dim: int, start: int, length: int) -> _Recorder:
        if dim != 0:
            raise ValueError("a GGUF weight is placed by rows")
        return _Recorder(length, self.shape[1], self._parts, self._offset + start)

    def __getitem__(self, index: slice) -> _Recorder:
        start, stop, _ = index.indices(self.shape[0])
        return self.narrow(0, start, max(stop - start, 0))

    def copy_(self, src) -> None:
        self._parts.append((self._offset, src))

    def zero_(self) -> None:  # padding rows of a vocabulary shard: zero blocks already
        pass


@dataclass(frozen=True)
class GGUFConfig(QuantizationConfig):
    types: tuple[str, ...] = ()  # the file's quantized types of the linears, most common first
    head_type: str = ""  # the LM head's (the embedding's, when tied)

    name = "gguf"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return GGUFLinearMethod()

    def get_embedding_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return GGUFLinearMethod()

    def describe(self) -> str:
        return f"gguf {'/'.join(self.types) or 'blocks'} (CPU kernels)"

    @classmethod
    def from_file(cls, path: str) -> GGUFConfig:
        """The types a GGUF file's 2-D tensors are stored in (its header only)."""
        import collections

        import gguf

        tensors = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
        head = tensors.get("output.weight") or tensors.get("token_embd.weight", "")
        counts = collections.Counter(q for name, q in tensors.items() if name.startswith("blk."))
        return cls(tuple(q for q, _ in counts.most_common()), head)


def file_weight_bytes(path: str, stage_of_layer: list[int], pp: int, tp: int) -> list[int]:
    """For the planner: bytes per pipeline stage of a GGUF file's tensors as stored (the engine
    keeps them in their blocks): a layer's to its stage, the embedding to the first, the rest
    to the last; 2-D tensors split over tp, norms replicated."""
    import gguf

    per_stage = [0] * pp
    for t in gguf.GGUFReader(path).tensors:
        nbytes = int(t.n_bytes) // (tp if len(t.shape) == 2 else 1)
        parts = t.name.split(".")
        if parts[0] == "blk":
            per_stage[stage_of_layer[int(parts[1])]] += nbytes
        else:
            per_stage[0 if t.name.startswith("token_embd") else -1] += nbytes
    return per_stage


class GGUFLinearMethod(LinearMethod):
    """One layer's GGUF weight (a linear, the embedding or the LM head: [rows, K] either way).
    `segments`: (first row, rows, type or "F32") per parameter, in row order."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, str]] = []
        self.k = 0
        self._parts: list | None = None
        self._tied: list[nn.Module] = []

    def create_weights(self, layer: nn.Module) -> None:
        rows, self.k = layer.weight.shape
        self._parts = []
        recorder = _Recorder(rows, self.k, self._parts)
        loader = layer.weight_loader  # the layer's own placing of rows and shards

        def load(param, loaded, shard_id=None) -> None:
            loader(recorder, loaded, shard_id)

        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.weight_loader = load  # type: ignore[attr-defined]
        layer.weight = placeholder
        self._rows = rows

    def tie(self, module: nn.Module) -> None:
        """`module` (a tied LM head) shares this layer's weight once it is built."""
        self._tied.append(module)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self._parts is None:  # a tied module, given its weight by the owner's call
            return
        parts = sorted(self._parts, key=lambda p: p[0])
        self._parts = None
        rows = self._rows
        groups: list[tuple[int, str, list]] = []  # (first row, type, tensors) of consecutive rows
        covered = 0
        for offset, src in parts:
            if offset < covered:
                raise ValueError(f"GGUF weight rows from {offset} were loaded twice")
            quant = isinstance(src, GGUFTensor)
            qtype = src.qtype if quant else "F32"
            if quant:
                data = src.blocks()
            else:
                data = (src if isinstance(src, torch.Tensor) else src.load()).to(torch.float32)
            if offset > covered:
                raise ValueError(f"GGUF weight rows [{covered}, {offset}) were not loaded")
            if groups and groups[-1][1] == qtype:
                groups[-1][2].append(data)
            else:
                groups.append((offset, qtype, [data]))
            covered = offset + data.shape[0]
        if covered < rows:  # a vocabulary shard's padding rows: zero blocks (which are zeros) or floats
            if not groups or covered < getattr(layer, "num_real", rows):
                raise ValueError(f"GGUF weight rows [{covered}, {rows}) were not loaded")
            last = groups[-1][2][-1]
            groups[-1][2].append(torch.zeros(rows - covered, last.shape[1], dtype=last.dtype))
        self.segments = []
        for i, (first, qtype, tensors) in enumerate(groups):
            weight = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            name = "weight" if i == 0 else f"weight_{i}"
            if name in layer._parameters:
                delattr(layer, name)
            layer.register_parameter(name, nn.Parameter(weight.contiguous(), requires_grad=False))
            self.segments.append((first, weight.shape[0], qtype))
        for module in self._tied:
            module.weight = layer.weight
            module.quant_method = self

    def _segment_weights(self, layer: nn.Module):
        for i, (first, n, qtype) in enumerate(self.segments):
            yield first, n, qtype, getattr(layer, "weight" if i == 0 else f"weight_{i}")

    def _product(self, x: torch.Tensor, w: torch.Tensor, qtype: str, out: torch.Tensor | None) -> torch.Tensor:
        if qtype == "F32":
            y = cpu_gemm.linear(x, w, None, None)
        elif x.shape[0] > (INT8_PREFILL_ROWS if qtype in gguf_kernels.INT8_TYPES and gguf_kernels.int8_mode()
                           else PREFILL_ROWS):
            y = F.linear(x, gguf_kernels.kernels().dequantize(w, qtype, self.k))
        else:
            return gguf_kernels.kernels().matmul(x, w, qtype, self.k, out=out)
        if out is None:
            return y
        out.copy_(y)
        return out

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        if len(self.segments) == 1:
            _, _, qtype, w = next(self._segment_weights(layer))
            y = self._product(x, w, qtype, None)
        else:
            y = torch.empty(x.shape[0], self._rows, dtype=torch.float32)
            for first, n, qtype, w in self._segment_weights(layer):
                self._product(x, w, qtype, y[:, first:first + n])
        return y if bias is None else y + bias

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` ([T] -> [T, K]), dequantized."""
        if len(self.segments) == 1 and self.segments[0][2] != "F32":
            return gguf_kernels.kernels().dequantize(layer.weight, self.segments[0][2], self.k, ids)
        out = torch.empty(ids.shape[0], self.k, dtype=torch.float32)
        for first, n, qtype, w in self._segment_weights(layer):
            sel = ((ids >= first) & (ids < first + n)).nonzero().squeeze(1)
            local = ids[sel] - first
            out[sel] = w[local] if qtype == "F32" else gguf_kernels.kernels().dequantize(w, qtype, self.k, local)
        return out

    def describe(self) -> str:
        return "gguf " + "/".join(dict.fromkeys(q for _, _, q in self.segments))
