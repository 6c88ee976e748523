"""GGUF quantized weights on the CPU: the C kernels of csrc/gguf_kernels.c through ctypes.

A weight stays in its GGUF blocks: a uint8 tensor [N, row_bytes] (each row one output feature's
K inputs, `K / block` blocks). `GGUFKernels.matmul` multiplies float32 activations by it (the C kernel
decodes each weight row once per tile of up to 64 activation rows and runs a register-blocked
float product: a decode step's rows share one decode, the weight bytes are read once);
`dequantize` turns rows (all, or those an index lists: an embedding lookup) into float32.
`dequantize_reference` is the `gguf` package's numpy dequantize, the reference both are tested
against.

Built like cpu_kernels (the same compiler, flags and cache; `PAGEDLLM_CPU_KERNELS=0` turns it
off): `available()` says whether it loaded.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import torch

from pagedllm.kernels.cpu_kernels import build_library, kernels_enabled

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "gguf_kernels.c")

# ggml type name -> (ggml type id, elements per block, bytes per block)
QUANT_TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}

# what a build without AVX2 / AVX-512 (the scalar C paths) adds to the usual flags
SCALAR_FLAGS = ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")


class GGUFKernels:
    """The compiled kernels (one shared object). `kernels()` is the process's default build."""

    def __init__(self, extra_flags: tuple[str, ...] = ()) -> None:
        lib = ctypes.CDLL(build_library(_SOURCE, extra_flags))
        i, i64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.gguf_dequantize_rows.restype = None
        lib.gguf_dequantize_rows.argtypes = [i, p, i64, i64, p, i64, p, i64, i]
        lib.gguf_matmul_f32.restype = None
        lib.gguf_matmul_f32.argtypes = [i, p, i64, i64, i64, p, i64, i64, p, i64, i]
        self._lib = lib

    def dequantize(self, w: torch.Tensor, qtype: str, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of a quantized weight as float32: all of them, or `ids` (integers, any shape) ->
        [*ids.shape, k]."""
        _check_weight(w, qtype, k)
        if ids is not None:
            shape = (*ids.shape, k)
            ids = ids.reshape(-1).to(torch.int64).contiguous()
            rows = ids.numel()
        else:
            shape, rows = (w.shape[0], k), w.shape[0]
        out = torch.empty(shape, dtype=torch.float32)
        if rows:
            self._lib.gguf_dequantize_rows(type_id(qtype), w.data_ptr(), w.stride(0), k,
                                           None if ids is None else ids.data_ptr(), rows, out.data_ptr(), k,
                                           torch.get_num_threads())
        return out

    def matmul(self, x: torch.Tensor, w: torch.Tensor, qtype: str, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, k] float32 @ W^T for a quantized W [N, row_bytes] -> [M, N]; into `out` (a
        float32 [M, N] view with unit column stride, e.g. a column slice of a fused layer's
        output) when given."""
        _check_weight(w, qtype, k)
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"activations must be float32 [M, {k}]; got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m, n = x.shape[0], w.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif tuple(out.shape) != (m, n) or out.dtype != torch.float32 or (m and n and out.stride(1) != 1):
            raise ValueError(f"out must be a float32 [{m}, {n}] view with unit column stride")
        if m and n:
            self._lib.gguf_matmul_f32(type_id(qtype), w.data_ptr(), w.stride(0), n, k, x.data_ptr(), x.stride(0), m,
                                      out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out


_default: GGUFKernels | None = None
_probed = False


def kernels() -> GGUFKernels | None:
    """The default build, or None where the kernels cannot be used (no compiler, or
    PAGEDLLM_CPU_KERNELS=0): GGUF weights are then dequantized at load."""
    global _default, _probed
    if not _probed:
        _probed = True
        if kernels_enabled():
            try:
                _default = GGUFKernels()
            except Exception as e:  # no compiler, a failed build
                logger.warning("GGUF CPU kernels unavailable: %s", e)
    return _default


def available() -> bool:
    return kernels() is not None


def type_id(qtype: str) -> int:
    if qtype not in QUANT_TYPES:
        raise ValueError(f"GGUF type {qtype!r} has no CPU kernel (supported: {', '.join(QUANT_TYPES)})")
    return QUANT_TYPES[qtype][0]


def row_bytes(qtype: str, k: int) -> int:
    type_id(qtype)
    _, block, size = QUANT_TYPES[qtype]
    if k % block:
        raise ValueError(f"{k} columns are not whole {qtype} blocks of {block}")
    return k // block * size


def _check_weight(w: torch.Tensor, qtype: str, k: int) -> None:
    if w.dtype != torch.uint8 or w.dim() != 2 or w.stride(1) != 1 or w.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"a {qtype} weight of {k} columns must be uint8 [N, {row_bytes(qtype, k)}] with "
                         f"contiguous rows; got {w.dtype} {tuple(w.shape)}")


def dequantize_reference(w: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """The `gguf` package's dequantize of the same rows (numpy), as float32 [N, k]."""
    import gguf

    data = gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(w.shape[0], k)
