"""Projection weights in MKL's packed GEMM format, for the CPU's decode steps.

At a decode step's few rows (2 to 48) `F.linear`'s sgemm spends much of its time re-laying
out the weight for its micro-kernel on every call. MKL can do that once: `cblas_sgemm_pack`
stores a weight in its internal blocked format, and `cblas_sgemm_compute` multiplies any
number of rows by it. torch's CPU build links MKL and exports both (torch's own
`mkl::_mkl_linear` falls back to the unpacked product unless the row count equals the one the
weight was packed for, so it cannot serve a batch that changes every step). Over SmolLM2's 30
layers and LM head this took a step's projections 10-30% less time at 2-32 rows and the same at
64; larger products (prefill) stay on `F.linear`, which is faster there
(benchmarks/RESULTS.md).

The packed copy is an extra copy of each weight: the buffer `cblas_sgemm_pack_get_size` asks
for is about 3x the weight, but pack writes about 1x of it and the rest is never touched, so
the resident cost is about the weights' size again. `PAGEDLLM_CPU_PACKED_GEMM=0` turns it off.

Only float32 on an MKL build of torch (x86); anywhere else `available()` is False and the
layers keep `F.linear`.
"""

from __future__ import annotations

import ctypes
import os

import torch

# CBLAS enum values (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
# the row count MKL is told at pack time (it picks the blocking; any row count works after)
_PACK_ROWS = 32
# products of at most this many rows use the packed weight
MAX_PACKED_ROWS = 48

_lib: ctypes.CDLL | None = None
_probed = False


def _mkl() -> ctypes.CDLL | None:
    global _lib, _probed
    if _probed:
        return _lib
    _probed = True
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        pack_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    pack_size.restype = ctypes.c_size_t
    pack_size.argtypes = [i, i, i, i]
    pack.restype = None
    pack.argtypes = [i, i, i, i, i, i, f, p, i, p]
    compute.restype = None
    compute.argtypes = [i, i, i, i, i, i, p, i, p, i, f, p, i]
    _lib = lib
    return lib


def available() -> bool:
    """Whether packed GEMMs can be used: torch links MKL and the switch is not off."""
    if os.environ.get("PAGEDLLM_CPU_PACKED_GEMM", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return torch.backends.mkl.is_available() and _mkl() is not None


class PackedWeight:
    """One [out, in] float32 weight packed for `y = x @ weight.T` (like `F.linear`)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("PackedWeight: a 2-D float32 CPU weight is required")
        lib = _mkl()
        if lib is None:
            raise RuntimeError("PackedWeight: torch is not linked with MKL's packed GEMM")
        self.out_features, self.in_features = n, k = weight.shape
        if weight.stride() == (1, n):  # column-major: stored as the [in, out] matrix itself
            trans, ld = _NO_TRANS, n
        else:
            weight = weight.contiguous()
            trans, ld = _TRANS, k
        size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS, n, k)
        # untouched pages of this buffer stay unallocated (see the module's docstring)
        self.buffer = torch.empty((size + 3) // 4, dtype=torch.float32)
        lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, trans, _PACK_ROWS, n, k, 1.0,
                             weight.data_ptr(), ld, self.buffer.data_ptr())
        self._compute = lib.cblas_sgemm_compute

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, in] float32 -> [M, out]."""
        x = x.contiguous()
        m, n, k = x.shape[0], self.out_features, self.in_features
        out = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), k,
                          self.buffer.data_ptr(), k, 0.0, out.data_ptr(), n)
        if bias is not None:
            out.add_(bias)
        return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """`F.linear`, through the packed weight when there is one and the product is small."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= MAX_PACKED_ROWS and x.dtype == torch.float32:
        return packed.linear(x, bias)
    return torch.nn.functional.linear(x, weight, bias)


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Gives each module that computes with a float32 CPU `weight` through `cpu_gemm.linear`
    (the parallel linears and the LM head, which declare `packed_weight`) its packed copy.
    Returns how many were packed (0 where packed GEMMs are not available)."""
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu":
            module.packed_weight = PackedWeight(w.data)
            count += 1
    return count
