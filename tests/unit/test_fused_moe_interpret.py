"""The MoE Triton kernels on the CPU through Triton's interpreter, against their torch
references: the checks of tests/gpu/test_fused_moe.py at small shapes, run in one subprocess by
the runner of test_kernels_interpret.py (TRITON_INTERPRET must be set before triton loads).
float32 and float16 only: the interpreter cannot run bf16 `tl.dot`."""

from __future__ import annotations

import pytest
from test_kernels_interpret import pytestmark, run_under_interpreter  # noqa: F401  (skips without triton)

# name -> (check, dtype, args, kwargs)
_CASES = {
    # uneven loads (3 hot experts), an expert no token picks, equal routing weights, 1 token
    "experts_hot:float32": ("check_fused_experts", [20, 32, 16, 8, 2], {"skew": "hot"}),
    "experts_empty:float16": ("check_fused_experts", [9, 32, 16, 8, 3], {"skew": "one-empty"}),
    "experts_ties:float32": ("check_fused_experts", [6, 32, 16, 4, 2], {"ties": True}),
    "experts_one_token:float32": ("check_fused_experts", [1, 64, 32, 8, 4], {}),
    "experts_ep2:float32": ("check_fused_experts", [12, 32, 16, 8, 2], {"skew": "hot", "ep_ranks": 2}),
    "align:int64": ("check_align", [30, 16, 4, 16], {}),
    "align_ep2:int32": ("check_align", [7, 8, 2, 16], {"ep_ranks": 2}),
    "topk:float32": ("check_topk_softmax", [5, 12, 3, False], {}),
    "topk_renorm_ties:float32": ("check_topk_softmax", [4, 16, 4, True], {"ties": True}),
}


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    # the shared runner (it widens only a module's own ELEMENTWISE_TOL; this one has none)
    return run_under_interpreter("test_fused_moe.py", _CASES)


@pytest.mark.parametrize("key", sorted(_CASES))
def test_moe_kernel_under_interpreter(results, key):
    assert results[key] is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{results[key]}"
