"""CPU kernels in C (csrc/cpu_kernels.c), called through ctypes; float32 only.

- `paged_decode_attention`: the torch reference gathers every decode's K/V blocks into a padded
  copy (`index_select`) and calls scaled_dot_product_attention, whose CPU kernel spends more on
  its per-(request, head) set-up than on the few hundred keys a decode attends to. The C kernel
  reads the blocks in place through the block table, one (request, kv head) pair per OpenMP
  work item, and keeps the softmax online per block.
- `argmax`: greedy sampling's argmax over the vocabulary, vectorized (torch's is not).
- `bitmask_fill_`: a grammar's packed bitmask applied to the logits in place (torch's
  unpack + masked_fill + index_copy took ~10 ms a step for 19 rows of 49,152 on one core).

The shared object is compiled on first use with the system's C compiler (`$CC`, else cc, gcc or
clang; `-O3 -march=native -ffp-contract=fast -fopenmp`, no -ffast-math; under a second) into the
user's cache directory (`$XDG_CACHE_HOME/pagedllm`, else ~/.cache/pagedllm), named by a hash of
the source, the flags and this CPU's feature flags, so a cache shared between machines of
different CPUs stays right. Its OpenMP is the one torch already loaded (same soname). Without a
compiler, or with `PAGEDLLM_CPU_KERNELS=0` (read once), `available()` is False and the torch
paths run.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cpu_kernels.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lib = None
_probed = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_has(*features: str) -> bool:
    """Whether this CPU reports every one of `features` (/proc/cpuinfo flag names, e.g.
    "avx_vnni"): a build that adds an -m flag past -march=native runs only where this holds."""
    flags = set(_cpu_flags().split())
    return all(f in flags for f in features)


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build_library(source: str = _SOURCE, extra_flags: tuple[str, ...] = ()) -> str:
    """The path of `source` (a C file of csrc/) compiled to a shared object, built if needed;
    `extra_flags` go after the usual ones (tests build a scalar variant with -mno-avx2 ...)."""
    flags = [*_FLAGS, *extra_flags]
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    with open(source, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    name = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(cache, f"{name}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, source, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders (TP ranks) each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def kernels_enabled() -> bool:
    """False when `PAGEDLLM_CPU_KERNELS` turns the C kernels off."""
    return os.environ.get("PAGEDLLM_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _load():
    global _lib, _probed
    if _probed:
        return _lib
    _probed = True
    if not kernels_enabled():
        return None
    try:
        lib = ctypes.CDLL(build_library())
    except Exception as e:  # no compiler, a failed build, an unloadable object: the torch path
        logger.warning("CPU kernels unavailable, using the torch paths: %s", e)
        return None
    i, i64, f, p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.paged_decode_attention_f32.restype = None
    lib.paged_decode_attention_f32.argtypes = [p, i64, p, p, p, i64, p, p, i, i, i, i, i, f, i, f, i]
    lib.argmax_rows_f32.restype = None
    lib.argmax_rows_f32.argtypes = [p, i64, i64, i64, p, i]
    lib.bitmask_fill_rows_f32.restype = None
    lib.bitmask_fill_rows_f32.argtypes = [p, i64, i64, p, i64, p, i64, i]
    lib.add_rms_norm_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [p, i64, p, i64, p, p, p, i64, i64, f, i]
    lib.rotary_f32.restype = None
    lib.rotary_f32.argtypes = [p, i64, p, i64, p, p, p, p, i64, i, i, i, i]
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


def _heads_ok(x: torch.Tensor) -> bool:
    """[T, H, D] float32 on the CPU with each head's D values contiguous and heads adjacent
    (any row stride): what the attention and rotary kernels read."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2])


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the decode kernel can take these tensors (see _heads_ok; the cache contiguous)."""
    return _heads_ok(q) and k_cache.dtype == torch.float32 and k_cache.is_contiguous()


def paged_decode_attention(
    q: torch.Tensor,  # [nd, Hq, D] float32, see supports()
    k_cache: torch.Tensor,  # [N, bs, Hkv, D] float32, contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= nd, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= nd] int32, each >= 1
    scale: float,
    sliding_window: int | None = None,  # attend to the last sliding_window tokens only
    logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
) -> torch.Tensor:  # [nd, Hq, D]
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    nd, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    bt = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 else \
        block_tables.to(torch.int32).contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() else \
        seq_lens.to(torch.int32).contiguous()
    assert v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    out = torch.empty(nd, hq, d, dtype=torch.float32)
    if nd:
        lib.paged_decode_attention_f32(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
                                       lens.data_ptr(), out.data_ptr(), nd, hq, hkv, d, bs, float(scale),
                                       int(sliding_window or 0), float(logits_soft_cap or 0.0),
                                       torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [rows, cols] tensor; through the C kernel for float32 on the CPU
    with unit column stride (torch's CPU argmax does not vectorize: 2 ms for 32 rows of
    SmolLM2's 49,152 logits, against 0.57 ms here)."""
    lib = _load() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    if lib is None or x.stride(1) != 1 or x.shape[1] == 0:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def bitmask_fill_(x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """x [S, V] float32: row rows[g] gets -inf at the tokens bitmask row g ([G, ceil(V / 32)]
    int32) does not allow, in place. False where the kernel does not apply (nothing done)."""
    lib = _load()
    if (lib is None or not _rows_ok(x) or bitmask.device.type != "cpu" or bitmask.dtype != torch.int32
            or not bitmask.is_contiguous() or bitmask.dim() != 2 or bitmask.shape[1] * 32 < x.shape[1]):
        return False
    rows = rows.to(torch.int64).contiguous()
    lib.bitmask_fill_rows_f32(x.data_ptr(), x.stride(0), x.shape[1], bitmask.data_ptr(), bitmask.shape[1],
                              rows.data_ptr(), rows.shape[0], torch.get_num_threads())
    return True


def _rows_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of [T, H] float32 rows in one call (torch's CPU rms_norm is six ops); with
    `residual`, returns (rms_norm(x + residual), x + residual) like fused_add_rms_norm. None
    where the kernel does not apply (the caller falls back to torch)."""
    lib = _load()
    if (lib is None or not _rows_ok(x) or not weight.is_contiguous() or weight.dtype != torch.float32
            or (residual is not None and (not _rows_ok(residual) or residual.shape != x.shape))):
        return None
    t, h = x.shape
    out = torch.empty(t, h, dtype=torch.float32)
    total = torch.empty(t, h, dtype=torch.float32) if residual is not None else None
    lib.add_rms_norm_f32(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                         0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
                         None if total is None else total.data_ptr(), t, h, float(eps), torch.get_num_threads())
    return out if residual is None else (out, total)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor):
    """apply_rotary_torch's result (bit for bit) in one call: q [T, Hq, D], k [T, Hkv, D] with
    contiguous heads -> views of one new [T, Hq + Hkv, D]. None where it does not apply."""
    lib = _load()
    if (lib is None or not _heads_ok(q) or not _heads_ok(k) or q.shape[2] % 2 or positions.dtype != torch.int64
            or not positions.is_contiguous() or cos_cache.dtype != torch.float32 or not cos_cache.is_contiguous()
            or not sin_cache.is_contiguous()):
        return None
    t, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(t, hq + hkv, d, dtype=torch.float32)
    lib.rotary_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), positions.data_ptr(), cos_cache.data_ptr(),
                   sin_cache.data_ptr(), out.data_ptr(), t, hq, hkv, d, torch.get_num_threads())
    return out[:, :hq], out[:, hq:]
