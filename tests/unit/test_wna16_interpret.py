"""The integer weight-only kernels (tests/gpu/test_wna16_gpu.py's checks) on the CPU through
Triton's interpreter, at small shapes, against their torch references: the GEMV (split-K, ragged
K) and the tensor-core GEMM (one scale row per tile, and tiles spanning several groups) over 4 and
8 bits, group and per-channel scales, symmetric and asymmetric zeros, bias; the dequantization
kernel. float32 and float16 activations (bf16 through `tl.dot` does not run in the interpreter,
see test_kernels_interpret.py)."""

from __future__ import annotations

import importlib.util

import pytest

from test_kernels_interpret import run_under_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_CASES = {
    "gemv_g32_sym": ("check_wna16_gemm", [1, 48, 256, 4, 32, True], {"config": ["gemv", 1, 16, 128, 4, 1, 1]}),
    "gemv_g64_asym_split_bias": ("check_wna16_gemm", [2, 40, 256, 4, 64, False],
                                 {"bias": True, "config": ["gemv", 1, 16, 64, 4, 1, 2]}),
    "gemv_channel_asym": ("check_wna16_gemm", [1, 32, 128, 4, None, False], {"config": ["gemv", 1, 32, 256, 4, 1, 1]}),
    "gemv_int8_ragged_k": ("check_wna16_gemm", [1, 32, 96, 8, 32, True], {"config": ["gemv", 1, 16, 64, 4, 1, 1]}),
    "gemv_int8_channel_split": ("check_wna16_gemm", [3, 24, 96, 8, None, False], {"config": ["gemv", 1, 16, 64, 4, 1, 2]}),
    "dot_g32_asym": ("check_wna16_gemm", [5, 48, 256, 4, 32, False], {"config": ["dot", 16, 16, 32, 4, 1, 1]}),
    "dot_tile_spans_groups_bias": ("check_wna16_gemm", [17, 40, 192, 4, 64, True],
                                   {"bias": True, "config": ["dot", 16, 32, 128, 4, 1, 1]}),
    "dot_channel_sym": ("check_wna16_gemm", [9, 32, 128, 4, None, True], {"config": ["dot", 16, 32, 32, 4, 1, 1]}),
    "dot_int8_asym": ("check_wna16_gemm", [9, 32, 96, 8, 32, False], {"config": ["dot", 16, 16, 32, 4, 1, 1]}),
    "default_configs": ("check_wna16_gemm", [6, 40, 256, 4, 128, False], {}),
    "dequant_g32_asym": ("check_wna16_dequant", [40, 256, 4, 32, False], {}),
    "dequant_int8_channel": ("check_wna16_dequant", [24, 96, 8, None, True], {}),
}
_DTYPES = ["float32", "float16"]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_wna16_gpu.py", {f"{n}:{d}": c for n, c in _CASES.items() for d in _DTYPES})


@pytest.mark.parametrize("key", [f"{n}:{d}" for n in _CASES for d in _DTYPES])
def test_wna16_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"
