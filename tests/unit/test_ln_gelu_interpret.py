"""The LayerNorm (+ residual) and bias + GELU Triton kernels on the CPU through Triton's
interpreter, against their torch references: the checks of tests/gpu/test_kernels_ln_gelu.py at
small shapes, in one subprocess by the runner of test_kernels_interpret.py. bf16 runs with the
runner's wider tolerance (the interpreter rounds float32 -> bf16 toward zero)."""

from __future__ import annotations

import pytest

from test_kernels_interpret import pytestmark, run_under_interpreter  # noqa: F401  (skips without triton)

_CASES = {
    f"{name}:{dtype}": (check, args, {})
    for name, check, args in (("layer_norm", "check_layer_norm", [5, 40]), ("bias_gelu", "check_bias_gelu", [3, 24]))
    for dtype in ("float32", "float16", "bfloat16")
}


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    return run_under_interpreter("test_kernels_ln_gelu.py", _CASES)


@pytest.mark.parametrize("key", sorted(_CASES))
def test_kernel_under_interpreter(results, key):
    assert results[key] is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{results[key]}"
