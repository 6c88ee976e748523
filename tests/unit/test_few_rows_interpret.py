"""The few-rows linear kernel on the CPU through Triton's interpreter (float32 and float16: the
interpreter cannot run bf16 `tl.dot`), its switch, and its sm_90 compilation."""

from __future__ import annotations

import re

import pytest
from test_kernels_interpret import pytestmark, run_under_interpreter  # noqa: F401  (skips without triton)

from pagedllm.kernels.few_rows import few_rows_max_rows

_CASES = {
    "one_row:float32": ("check_few_rows", [1, 48, 64], {}),
    "rows_off_tiles:float16": ("check_few_rows", [5, 37, 200], {}),
    "sixteen_bias:float32": ("check_few_rows", [16, 40, 96], {"bias": True}),
    "router_fp32_out:float16": ("check_few_rows", [2, 24, 64], {"out_float32": True}),
    "tile:float32": ("check_few_rows", [3, 70, 300], {"config": (32, 64, 4, 2)}),
}


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    return run_under_interpreter("test_few_rows.py", _CASES)


@pytest.mark.parametrize("key", sorted(_CASES))
def test_few_rows_under_interpreter(results, key):
    assert results[key] is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{results[key]}"


def test_switch():
    assert few_rows_max_rows({}) == 0
    assert few_rows_max_rows({"PAGEDLLM_FEW_ROWS_GEMV": "8"}) == 8
    for bad in ("17", "-1", "x"):
        with pytest.raises(ValueError, match="PAGEDLLM_FEW_ROWS_GEMV"):
            few_rows_max_rows({"PAGEDLLM_FEW_ROWS_GEMV": bad})


@pytest.mark.parametrize("n, k", [(5120, 2048), (2048, 4096)])
def test_compiles_for_sm90(n, k):
    """Tensor-core products fed by pipelined loads, at the default tiles of Qwen3-30B-A3B's q/k/v
    and o projections."""
    from test_fp8_interpret import _compile_sm90

    from pagedllm.kernels import few_rows_triton as f

    bn, bk, nw, ns = f.default_config(n, k)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
    consts = {"HAS_BIAS": False, "DOT_PRECISION": "tf32", "BLOCK_M": f.BLOCK_M, "BLOCK_N": bn,
              "BLOCK_K": bk}
    ptx = _compile_sm90(f._few_rows_kernel, sig, consts, nw, ns).asm["ptx"]
    assert "mma" in ptx and "cp.async" in ptx
    # 16-byte weight loads (8 bf16 a copy), not element by element
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10", ptx)
