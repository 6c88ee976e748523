"""GGUF quantized weights on the CPU: the C kernels of csrc/gguf_kernels.c through ctypes.

A weight stays in its GGUF blocks: a uint8 tensor [N, row_bytes] (each row one output feature's
K inputs, `K / block` blocks). `GGUFKernels.matmul` multiplies float32 activations by it (the C kernel
decodes each weight row once per tile of up to 64 activation rows and runs a register-blocked
float product: a decode step's rows share one decode, the weight bytes are read once);
`dequantize` turns rows (all, or those an index lists: an embedding lookup) into float32.

For Q4_0, Q4_1 and Q8_0 the product has an integer path (`gguf_matmul_q8`): the activation
rows are quantized once per call to int8 in blocks of 32 (Q8_0-like: a float scale max|x| / 127
per block; `quantize_activations` gives them), and each block's dot product with a weight block
is a u8 x s8 integer sum (VPDPBUSD on AVX512-VNNI / AVX-VNNI, VPMADDUBSW on plain AVX2, C
otherwise), scaled once per block. Mode 1 is that (llama.cpp's scheme); mode 2 also quantizes
what the first codes rounded off (at 254 times finer a scale) and adds its integer dot product
(254 * sum1 + sum2, exact in int32): about int16 precision for twice the dot instructions. One
pass's ~1% activation error flips the embedded SmolLM2's answer to "What is the capital of
France?" (benchmarks/RESULTS.md); two passes keep it. `PAGEDLLM_GGUF_INT8` (read once) picks the
mode: 0 keeps float32 activations for every type (the reference path; the K-quants always run
it), 1 or 2; default 2.
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

# the types the int8-activation product covers
INT8_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})

# extra flags of the builds the tests compare (each #if branch of the C file): the plain AVX2
# one (no AVX-512, no AVX-VNNI: VPMADDUBSW), AVX2 with AVX-VNNI, and the scalar C one below
AVX2_FLAGS = ("-mno-avx512f", "-mno-avxvnni")
AVX2_VNNI_FLAGS = ("-mno-avx512f", "-mavxvnni")
# the CPU flag that build needs to run (-mavxvnni goes past -march=native: without the feature
# its VPDPBUSD is an illegal instruction)
AVX2_VNNI_CPU_FLAG = "avx_vnni"

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
        lib.gguf_matmul_q8.restype = i
        lib.gguf_matmul_q8.argtypes = [i, p, i64, i64, i64, p, i64, i64, p, i64, i, i]
        lib.gguf_quantize_rows_q8.restype = None
        lib.gguf_quantize_rows_q8.argtypes = [p, i64, i64, i64, p, p, p, p]
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

    def quantize_activations(self, x: torch.Tensor, passes: int = 1):
        """What the int8 product makes of float32 activations [M, K] (K a multiple of 32):
        (q, r, d, s). One pass: codes q int8 [M, K], r None, per-block scales d float32
        [M, K / 32] (max|x| / 127) and s = d times each block's sum of codes; x ~ q * d (d
        repeated over each block's 32). Two: r the residual's codes, int8 [M, K], and d the
        first pass's scale / 254: x ~ (254 q + r) * d, s = d * sum(254 q + r)."""
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes!r}")
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32:
            raise ValueError(f"x must be float32 [M, K] with K a multiple of 32; got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        r = torch.empty(m, k, dtype=torch.int8) if passes == 2 else None
        d = torch.empty(m, k // 32, dtype=torch.float32)
        s = torch.empty(m, k // 32, dtype=torch.float32)
        if m:
            self._lib.gguf_quantize_rows_q8(x.data_ptr(), x.stride(0), m, k, q.data_ptr(),
                                            None if r is None else r.data_ptr(), d.data_ptr(), s.data_ptr())
        return q, r, d, s

    def matmul(self, x: torch.Tensor, w: torch.Tensor, qtype: str, k: int,
               out: torch.Tensor | None = None, int8: int | None = None) -> torch.Tensor:
        """x [M, k] float32 @ W^T for a quantized W [N, row_bytes] -> [M, N]; into `out` (a
        float32 [M, N] view with unit column stride, e.g. a column slice of a fused layer's
        output) when given. `int8`: 1 or 2 quantizes the activations to int8 in that many passes
        and multiplies in integers (Q4_0, Q4_1, Q8_0 only); 0 keeps them float32; None: the
        default (int8_mode() for those types, 0 for the K-quants)."""
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
        if int8 is None:
            int8 = int8_mode() if qtype in INT8_TYPES else 0
        if int8 not in (0, 1, 2):
            raise ValueError(f"int8 must be 0, 1 or 2 (passes), got {int8!r}")
        if int8 and qtype not in INT8_TYPES:
            raise ValueError(f"int8: no int8-activation product for {qtype} (only {', '.join(sorted(INT8_TYPES))})")
        if m and n and int8:
            self._lib.gguf_matmul_q8(type_id(qtype), w.data_ptr(), w.stride(0), n, k, x.data_ptr(), x.stride(0), m,
                                     out.data_ptr(), out.stride(0), int(int8), torch.get_num_threads())
        elif m and n:
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


DEFAULT_INT8_MODE = 2
_int8: int | None = None


def int8_mode() -> int:
    """How Q4_0 / Q4_1 / Q8_0 products treat the activations: `PAGEDLLM_GGUF_INT8` (read once):
    0 float32, 1 int8 in one pass, 2 int8 with the residual's pass (the default)."""
    global _int8
    if _int8 is None:
        raw = os.environ.get("PAGEDLLM_GGUF_INT8", str(DEFAULT_INT8_MODE)).strip().lower()
        named = {"false": 0, "no": 0, "off": 0, "true": DEFAULT_INT8_MODE, "yes": DEFAULT_INT8_MODE,
                 "on": DEFAULT_INT8_MODE}
        _int8 = named.get(raw, int(raw) if raw in ("0", "1", "2") else None)
        if _int8 is None:
            raise ValueError(f"PAGEDLLM_GGUF_INT8 must be 0, 1 or 2, got {raw!r}")
    return _int8


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
