"""The Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), at tiny
shapes, against their torch references. The checks are the GPU tests' own `check_*` functions
(tests/gpu/test_kernels.py, and test_sampling_gpu.py for the sampler's) run with device="cpu".

TRITON_INTERPRET must be set before triton is imported, so all cases of a check file run in one
subprocess (one import of torch and triton) and each test reads its case's result.

What the interpreter cannot run, and is left to the GPU tests:
- bfloat16 through `tl.dot` (the attention kernels): Triton's interpreter (3.6 to 3.9) multiplies
  the raw bf16 bits and returns garbage. The runner widens bf16 dot operands to float32 first
  (exact), which the 16-bit small-row GEMM's cases use (test_small_m_interpret.py); the
  attention cases here still leave bf16 to the GPU tests. bf16 elementwise kernels run fine.
- exact bf16 rounding: the interpreter casts float32 -> bf16 toward zero, so bf16 cases run
  with a wider tolerance here than on the GPU.
- speed and CUDA graphs, of course.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# name -> (check function, args after device and dtype, kwargs); dtypes below
_CASES = {
    "rms_norm": ("check_rms_norm", [5, 40], {}),
    "silu_and_mul": ("check_silu_and_mul", [3, 24], {}),
    "gelu_tanh_and_mul": ("check_gelu_tanh_and_mul", [3, 24], {}),
    "rotary_gqa": ("check_rotary", [4, 6, 2, 16], {"max_pos": 64}),
    "store_kv_bs16": ("check_store_kv", [21, 2, 16, 16], {}),
    "store_kv_bs32": ("check_store_kv", [21, 3, 24, 32], {}),
    "store_kv_v_key_major": ("check_store_kv", [21, 2, 16, 16], {"v_key_major": True}),
    # decode: GQA 4/2, a context long enough for several tiles; forced 1 and 3 splits, then the heuristic
    "decode_one_split": ("check_decode", [[1, 70, 17], 4, 2, 16, 16], {"num_splits": 1}),
    "decode_split_k": ("check_decode", [[1, 70, 17], 4, 2, 16, 32], {"num_splits": 3}),
    # prefill: a fresh prompt, a chunk after a cached prefix, a one-token chunk; 16x16 tiles
    "prefill_cached_prefix": ("check_prefill", [[5, 20, 1], [5, 37, 20], 4, 2, 16, 16], {"config": (16, 16, 1, 1)}),
    # backend: 2 decodes + 2 prefills (one over a cached prefix) + 2 padding tokens (slot -1)
    # the fused sampler: greedy rows, the softmax law over 300 draws of 6 tokens (the GPU test
    # draws 20000), -inf never drawn; each program is slow to interpret, so few rows
    "sample": ("check_sample", [6, 300], {}),
    "sample_bitmask": ("check_sample_bitmask", [100, 12], {}),
    "sample_chunks": ("check_sample_chunks", [200, 7, 16], {}),
    "backend_mixed": ("check_backend", [[1, 1, 6, 18], [9, 30, 6, 40], 2, 4, 2, 16, 16], {"pad_tokens": 2}),
    # the programs taking the requests in another order (longest first, shuffled): same output
    "decode_ordered": ("check_decode", [[1, 70, 17, 40], 4, 2, 16, 16], {"num_splits": 1, "order": "desc"}),
    "decode_ordered_split_k": ("check_decode", [[1, 70, 17, 40], 4, 2, 16, 16], {"num_splits": 3, "order": "shuffled"}),
    "backend_ordered": ("check_backend", [[1, 1, 1, 6, 18], [9, 40, 30, 6, 40], 3, 4, 2, 16, 16],
                        {"order_decodes": True}),
    # sliding window (shorter and longer than the contexts) and logit soft cap (Gemma 2)
    "decode_window_split_k": ("check_decode", [[1, 70, 17], 4, 2, 16, 16], {"num_splits": 3, "sliding_window": 20}),
    # the last split of each (request, kv head) merges the splits (no reduce kernel): empty
    # partitions (a 1-token context over 3 splits), the longest-first order, a window; twice
    "decode_last_reduce": ("check_decode", [[1, 70, 17], 4, 2, 16, 16],
                           {"num_splits": 3, "last_reduce": True, "calls": 2}),
    # 21 of 40 splits holding keys: several rounds of the merge's maxima and outputs
    "decode_last_reduce_many_splits": ("check_decode", [[1300, 5], 4, 2, 16, 16],
                                       {"num_splits": 40, "last_reduce": True}),
    "decode_last_reduce_unroll_8": ("check_decode", [[1300, 5], 4, 2, 16, 16],
                                    {"num_splits": 40, "last_reduce": True, "merge_unroll": 8}),
    "decode_last_reduce_ordered_window": ("check_decode", [[1, 70, 17, 40], 8, 2, 16, 16],
                                          {"num_splits": 4, "order": "desc", "sliding_window": 20,
                                           "last_reduce": True}),
    "prefill_window_cached_prefix": ("check_prefill", [[5, 20, 1], [5, 37, 20], 4, 2, 16, 16],
                                     {"config": (16, 16, 1, 1), "sliding_window": 7}),
    "backend_window_softcap": ("check_backend", [[1, 1, 6, 18], [9, 30, 6, 40], 2, 4, 2, 16, 16],
                               {"sliding_window": 12, "logits_soft_cap": 2.0}),
    # V blocks stored key-major (FP8's layout; PAGEDLLM_V_TRANSPOSED for 16-bit caches), 32-token
    # blocks and a window that starts inside a block
    "backend_v_key_major": ("check_backend", [[1, 1, 6, 18], [9, 30, 6, 40], 2, 4, 2, 16, 32], {"v_key_major": True}),
    "backend_window_v_key_major": ("check_backend", [[1, 1, 1, 6, 18], [9, 70, 30, 6, 40], 3, 4, 2, 16, 16],
                                   {"sliding_window": 21, "logits_soft_cap": 2.0, "v_key_major": True}),
}
_DOTLESS = {"rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_gqa", "store_kv_bs16", "store_kv_bs32",
            "store_kv_v_key_major",
            "sample", "sample_bitmask", "sample_chunks"}
_DTYPES = ["float32", "float16", "bfloat16"]
_LOGITS_DTYPES = {"sample", "sample_bitmask", "sample_chunks"}  # logits: float32, or a 16-bit LM head's bfloat16
_SAMPLER_CASES = _LOGITS_DTYPES  # their checks live in tests/gpu/test_sampling_gpu.py

_RUNNER = r"""
import importlib.util, json, os, sys, traceback
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds with
# int(array), which numpy >= 2.4 refuses for arrays of one dimension; read the element instead.
_patch = getattr(interpreter, "_patch_lang_tensor", None)
if _patch is not None:
    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patch_lang_tensor

# Its float32 -> float8 rounding drops the carry of a rounded-up mantissa (7.76 -> 4.0 in e4m3)
# and ignores the sticky bits; the GPU rounds to nearest even. Round through torch instead.
import numpy as np
import triton.language as tl
_convert_float = interpreter._convert_float
_FP8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
def _convert_float_fp8(input, input_dtype, output_dtype, rounding_mode):
    if str(output_dtype) in _FP8 and input_dtype == tl.float32:
        x = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np.float32).copy())
        return x.to(_FP8[str(output_dtype)]).view(torch.uint8).numpy().reshape(input.shape)
    return _convert_float(input, input_dtype, output_dtype, rounding_mode)
interpreter._convert_float = _convert_float_fp8

# Its dot multiplies bfloat16 operands as their raw uint16 bits: widen them to float32 (exact).
_create_dot = interpreter.InterpreterBuilder.create_dot
def _widen_bf16(h):
    if h.dtype.scalar != tl.bfloat16:
        return h
    return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
def _create_dot_bf16(self, a, b, d, *args):
    return _create_dot(self, _widen_bf16(a), _widen_bf16(b), d, *args)
interpreter.InterpreterBuilder.create_dot = _create_dot_bf16

spec = importlib.util.spec_from_file_location("kernel_checks", sys.argv[1])
checks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checks)
# The interpreter rounds float32 -> bf16 toward zero (the GPU rounds to nearest), so a bf16
# residual sum can be off by an ulp and the norm after it by a few: a wider bf16 tolerance here.
if hasattr(checks, "ELEMENTWISE_TOL"):
    checks.ELEMENTWISE_TOL[torch.bfloat16] = (5e-2, 5e-2)
results = {}
for key, (fn, args, kwargs) in json.loads(sys.argv[2]).items():
    name, dtype = key.split(":")
    if "config" in kwargs:
        kwargs["config"] = tuple(kwargs["config"])
    try:
        getattr(checks, fn)("cpu", getattr(torch, dtype), *args, **kwargs)
        results[key] = None
    except Exception:
        results[key] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results))
"""


def _keys():
    for name in _CASES:
        for dtype in _DTYPES:
            if name in _LOGITS_DTYPES and dtype == "float16":
                continue
            if dtype == "bfloat16" and name not in _DOTLESS:
                continue  # see the module docstring: no bf16 tl.dot in the interpreter
            yield f"{name}:{dtype}"


def run_under_interpreter(check_file: str, cases: dict) -> dict[str, str | None]:
    """Runs `cases` ({"name:dtype": (check function, args, kwargs)}) of tests/gpu/`check_file`
    under the interpreter; returns {key: None, or the failure's traceback}. The cases are dealt
    round-robin to one subprocess per core (at most two, and at most one per three cases): each
    interprets on one core, so two halve the wall time on CI's two cores."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    keys = list(cases)
    workers = max(1, min(2, os.cpu_count() or 1, len(keys) // 3))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RUNNER, str(ROOT / "tests" / "gpu" / check_file),
             json.dumps({key: cases[key] for key in keys[w::workers]})],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for w in range(workers)
    ]
    results: dict[str, str | None] = {}
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
        lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
        assert proc.returncode == 0 and lines, f"interpreter run failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        results.update(json.loads(lines[-1][len("RESULTS ") :]))
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for check_file, sampler in (("test_kernels.py", False), ("test_sampling_gpu.py", True)):
        keys = [key for key in _keys() if (key.split(":")[0] in _SAMPLER_CASES) == sampler]
        results.update(run_under_interpreter(check_file, {key: _CASES[key.split(":")[0]] for key in keys}))
    return results


@pytest.mark.parametrize("key", list(_keys()))
def test_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"
