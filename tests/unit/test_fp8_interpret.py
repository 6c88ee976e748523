"""The FP8 kernels (tests/gpu/test_fp8_gpu.py's checks) on the CPU through Triton's interpreter, at
small shapes, against their torch references: the W8A16 GEMV and tensor-core GEMM (per-channel
and K-group scales, ragged shapes, bias), the per-token quantization, and the attention kernels
on e4m3 / e5m2 KV caches with scales. bfloat16 through `tl.dot` does not run in the interpreter
(test_kernels_interpret.py says why): float32 and float16 activations here."""

from __future__ import annotations

import importlib.util

import pytest

from test_kernels_interpret import run_under_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_GEMV = ["gemv", 1, 8, 32, 4, 1]
_DOT = ["dot", 16, 16, 32, 4, 1]
_MIXED = {"query_lens": [1, 1, 6, 18], "seq_lens": [9, 30, 6, 40], "num_decodes": 2,
          "hq": 4, "hkv": 2, "head_dim": 16, "block_size": 16}
_CASES = {
    "gemv_channel": ("check_fp8_gemm", [1, 40, 72], {"config": _GEMV}),
    "gemv_rows_bias": ("check_fp8_gemm", [3, 40, 64], {"bias": True, "config": _GEMV}),
    "gemv_groups": ("check_fp8_gemm", [2, 24, 96], {"group_k": 32, "config": _GEMV}),
    "dot_channel": ("check_fp8_gemm", [17, 40, 72], {"config": _DOT}),
    "dot_groups_bias": ("check_fp8_gemm", [20, 24, 96], {"group_k": 32, "bias": True, "config": _DOT}),
    "per_token_quant": ("check_per_token_quant", [5, 40], {}),
    "kv_e4m3_scaled": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e4m3", k_scale=0.05, v_scale=0.3)),
    "kv_e4m3_split_k": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e4m3", num_splits=3)),
    "kv_e5m2": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e5m2", k_scale=0.5, v_scale=2.0)),
    "kv_reference_semantics": ("check_fp8_reference", [], dict(_MIXED, cache="fp8_e4m3", k_scale=0.5, v_scale=2.0)),
}
_DTYPES = ["float32", "float16"]


def _positional(case):
    fn, args, kwargs = case
    if fn in ("check_fp8_backend", "check_fp8_reference"):  # its batch arguments are given by name
        mixed = {k: kwargs[k] for k in _MIXED}
        rest = {k: v for k, v in kwargs.items() if k not in _MIXED}
        return fn, [mixed[k] for k in _MIXED] + args, rest
    return fn, args, kwargs


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    cases = {f"{name}:{dt}": _positional(case) for name, case in _CASES.items() for dt in _DTYPES}
    return run_under_interpreter("test_fp8_gpu.py", cases)


@pytest.mark.parametrize("key", [f"{n}:{d}" for n in _CASES for d in _DTYPES])
def test_fp8_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"
