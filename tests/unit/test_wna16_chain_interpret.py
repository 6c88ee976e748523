"""The persistent 4-bit MLP kernel (kernels/wna16_chain_triton.py) on the CPU: the GPU check of
tests/gpu/test_wna16_chain_gpu.py through Triton's interpreter at small shapes (a stage a launch:
the interpreter runs programs one after another, so none could wait at the grid barrier) against
the torch reference of gate_up, SiLU-and-mul and down: more units than programs and ragged last
units (outputs that are no multiple of the tiles), K ranges that are no multiple of the K tile,
groups of 32 / 128 and per channel, symmetric and asymmetric, the steps-permuted layout; and the
kernel compiled for the H200 as the GPU runs it: the grid barrier's atomics at gpu scope, the
SiLU-and-mul product read through L2 (.cg) after it."""

from __future__ import annotations

import importlib.util
import re

import pytest
from test_kernels_interpret import run_under_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# (k, i, h) + kwargs; config: (BLOCK_N_GU, BLOCK_KW_GU, BLOCK_N_D, BLOCK_KW_D, warps, programs an SM), 4 programs
_CASES = {
    "g32_asym_ragged": ("check_mlp_chain", [256, 96, 40], {"group_k": 32, "symmetric": False,
                                                           "config": [64, 16, 16, 4, 4, 1]}),
    "g128_sym_kperm": ("check_mlp_chain", [256, 256, 48], {"group_k": 128, "kperm": True,
                                                           "config": [16, 16, 8, 16, 4, 1]}),
    # o [h, k], the residual add and RMSNorm before the MLP (whose input is then h wide)
    "with_o_g32_asym": ("check_mlp_chain", [256, 64, 96], {"group_k": 32, "symmetric": False, "with_o": True,
                                                           "config": [16, 16, 16, 4, 4, 1, 16, 8]}),
    "with_o_g128_kperm": ("check_mlp_chain", [256, 128, 128], {"group_k": 128, "kperm": True, "with_o": True,
                                                               "config": [16, 16, 8, 16, 4, 1], "calls": 1}),
    "channel_asym_k_tail": ("check_mlp_chain", [192, 40, 24], {"group_k": None, "symmetric": False,
                                                               "config": [8, 16, 8, 4, 4, 1], "calls": 1}),
}


def _keys():
    for name in _CASES:
        for dtype in ("float16", "bfloat16"):
            yield f"{name}:{dtype}"


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_wna16_chain_gpu.py", {key: _CASES[key.split(":")[0]] for key in _keys()})


@pytest.mark.parametrize("key", list(_keys()))
def test_mlp_chain_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


@pytest.mark.parametrize("has_o", [False, True])
def test_mlp_chain_compiles_for_sm90(has_o):
    """The persistent launch (STAGE -1) compiled for the H200, with and without o and the norm in
    front: the barriers' counts release atomics and their waits acquire loads at gpu scope, what other
    programs wrote (the product, the normed row) read through L2 (ld.global.cg: L1 is not coherent with
    the other SMs' stores), the PDL wait, nothing spilled under the register cap of DEFAULT_CONFIG's
    programs an SM."""
    from pagedllm.kernels import wna16_chain_triton as c
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    ptrs = ("x_ptr", "ow_ptr", "os_ptr", "oz_ptr", "res_ptr", "nw_ptr", "obuf_ptr", "xn_ptr", "res_out_ptr", "gw_ptr",
            "gs_ptr", "gz_ptr", "dw_ptr", "ds_ptr", "dz_ptr", "act_ptr", "out_ptr", "bar_ptr")  # fmt: skip
    ints = ("INTER", "H", "KW_O", "KW_GU", "KW_D", "stride_ow", "stride_os", "stride_gw", "stride_gs", "stride_dw",
            "stride_ds")  # fmt: skip
    sig = {p: "*i32" if p.startswith(("ow", "gw", "dw", "bar")) else "*bf16" for p in ptrs}
    sig.update({"eps": "fp32", **dict.fromkeys(ints, "i32")})
    bn_gu, bkw_gu, bn_d, bkw_d, warps, per_sm = c.DEFAULT_CONFIG
    const = {"GROUP_O": 128, "GROUP_GU": 128, "GROUP_D": 128, "HAS_ZERO": False, "BLOCK_N_O": bn_d, "BLOCK_KW_O": bkw_d,
             "BLOCK_N_GU": bn_gu, "BLOCK_KW_GU": bkw_gu, "BLOCK_N_D": bn_d, "BLOCK_KW_D": bkw_d, "BLOCK_H": 4096,
             "ASM": True, "KPERM_O": True, "KPERM_GU": True, "KPERM_D": True, "HAS_O": has_o, "STAGE": -1,
             "PDL": True}  # fmt: skip
    compiled = compile_sm90(c._mlp_chain_kernel, sig, const, warps, 2, maxnreg=65536 // (per_sm * warps * 32),
                            aligned=ints)
    ptx = compiled.asm["ptx"]
    # (the waits' atomic add of 0 is compiled as an acquire load: what a spin wants)
    assert len(re.findall(r"(red|atom)\.global\.gpu\.(release|acq_rel)\.add", ptx)) >= (4 if has_o else 2), \
        "the barriers' counts"
    assert len(re.findall(r"ld\.global\.gpu\.acquire", ptx)) == (2 if has_o else 1), "the barriers' waits"
    assert "ld.global.cg" in ptx and "griddepcontrol.wait" in ptx
    r = resources(compiled)
    if r is None:
        pytest.skip("Triton's cuobjdump is not there")
    assert r["stack"] == 0, r
