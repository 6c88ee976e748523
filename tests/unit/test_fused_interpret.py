"""The fused decode-step kernels (tests/gpu/test_fused_gpu.py's checks) on the CPU through
Triton's interpreter, at tiny shapes, against their torch references: q/k RMSNorm + rotary +
store-KV (with and without the norm, an odd half width, 16-bit and FP8 caches, padding slots;
and against the unfused Triton kernels), and the FP8 gate_up product with SiLU-and-mul in its
epilogue (GEMV and swap-AB, K-group scales, bias). Then both compile for sm_90 here, so the GPU
run meets no compile error: the gated swap-AB kernel still on wgmma with paired e4m3 -> fp16
conversions."""

from __future__ import annotations

import importlib.util

import pytest
from test_fp8_interpret import _compile_sm90
from test_kernels_interpret import run_under_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_GEMV = ["gemv", 1, 8, 32, 4, 1]
_SWAP = ["swap", 16, 32, 32, 4, 1]
_CASES = {
    "rope_store": ("check_qkv_rope_store", [5, 4, 2, 16, 16], {}),
    "norm_rope_store": ("check_qkv_rope_store", [5, 4, 2, 16, 16], {"qk_norm": True}),
    "norm_rope_store_odd_half": ("check_qkv_rope_store", [4, 3, 1, 24, 16], {"qk_norm": True, "block_h": 2}),
    "norm_rope_store_fp8": ("check_qkv_rope_store", [6, 4, 2, 16, 16],
                            {"qk_norm": True, "cache": "fp8_e4m3", "k_scale": 0.05, "v_scale": 0.3}),
    "rope_store_e5m2": ("check_qkv_rope_store", [6, 4, 2, 16, 16], {"cache": "fp8_e5m2", "k_scale": 0.5}),
    "norm_rope_store_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16],
                                   {"qk_norm": True}),
    "rope_store_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16], {}),
    "rope_store_fp8_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16],
                                  {"cache": "fp8_e4m3", "k_scale": 0.1, "v_scale": 0.2}),
    # the attention layers' wiring: fused vs unfused on a mixed batch (float32: the attention
    # kernels' dots, which the interpreter cannot run in 16 bits)
    "layer_llama": ("check_attention_layer_fused", ["llama"], {}),
    "layer_qwen3": ("check_attention_layer_fused", ["qwen3"], {}),
    "silu_gemv": ("check_fp8_silu_gemm", [1, 24, 64], {"config": _GEMV}),
    "silu_gemv_groups_bias": ("check_fp8_silu_gemm", [1, 24, 96], {"group_k": 32, "bias": True, "config": _GEMV}),
    "silu_gemv_ragged": ("check_fp8_silu_gemm", [2, 20, 72], {"config": _GEMV}),
    "silu_gemv_bit_equal": ("check_fp8_silu_gemv_bit_equal", [40, 64], {}),
    "silu_swap": ("check_fp8_silu_gemm", [3, 24, 64], {"config": _SWAP}),
    "silu_swap_groups_bias": ("check_fp8_silu_gemm", [5, 40, 96], {"group_k": 32, "bias": True, "config": _SWAP}),
}
_DTYPES = ["float32", "float16", "bfloat16"]


def _keys():
    for name in _CASES:
        for dt in ["float32"] if name.startswith("layer_") else _DTYPES:
            yield f"{name}:{dt}"


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_fused_gpu.py", {key: _CASES[key.split(":")[0]] for key in _keys()})


@pytest.mark.parametrize("key", list(_keys()))
def test_fused_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


@pytest.mark.parametrize("cache", ["*bf16", "*fp8e4nv"])
@pytest.mark.parametrize("has_norm", [False, True])
def test_qkv_rope_store_compiles_for_sm90(cache, has_norm):
    from pagedllm.kernels import qkv_rope_triton as r

    signature = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                 "qw_ptr": "*bf16", "kw_ptr": "*bf16", "q_out_ptr": "*bf16", "k_cache_ptr": cache,
                 "v_cache_ptr": cache, "slot_ptr": "*i64"}
    signature.update(dict.fromkeys(["stride_qkv", "stride_qot", "stride_qoh", "stride_cos", "stride_sin",
                                    "stride_kcb", "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs",
                                    "stride_vch", "num_q_heads", "num_kv_heads"], "i32"))
    signature.update(dict.fromkeys(["eps", "inv_k_scale", "inv_v_scale"], "fp32"))
    constexprs = {"HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 4, "BLOCK_SIZE": 16,
                  "HAS_NORM": has_norm, "FP8_MAX": 448.0 if cache == "*fp8e4nv" else 0.0}
    compiled = _compile_sm90(r._qkv_rope_store_kernel, signature, constexprs, num_warps=2, num_stages=1)
    ptx = compiled.asm["ptx"]
    assert "st.global" in ptx
    if cache == "*fp8e4nv":
        assert "cvt.rn.satfinite.e4m3x2" in ptx  # two values per conversion into the cache


_FP8_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16"}


@pytest.mark.parametrize("block_n", [32, 64])
def test_gated_swap_kernel_compiles_for_sm90(block_n):
    from pagedllm.kernels import fp8_triton as f

    signature = dict(_FP8_SIG, M="i32", N="i32", K="i32", K_SPLIT="i32", stride_xm="i32", stride_wn="i32",
                     stride_sn="i32", stride_om="i32")
    constexprs = {"GROUP_K": 0, "HAS_BIAS": False, "EVEN_K": True, "SPLIT_K": 1, "BLOCK_M": f.SWAP_BLOCK_M,
                  "BLOCK_N": block_n, "BLOCK_K": 128, "FP16_OPERANDS": True, "FP16_MAX_": f.FP16_MAX, "GATED": True}
    ptx = _compile_sm90(f._fp8_swap_kernel, signature, constexprs, num_warps=4, num_stages=3).asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.f32.f16" not in ptx
    assert "mma" in ptx and "cp.async" in ptx
    assert "ex2.approx" in ptx  # the SiLU in the epilogue


@pytest.mark.parametrize("gated", [False, True])
def test_gemv_kernel_compiles_for_sm90(gated):
    from pagedllm.kernels import fp8_triton as f

    signature = dict(_FP8_SIG, N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_sn="i32", stride_om="i32")
    constexprs = {"GROUP_K": 0, "HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": 8, "BLOCK_K": 256, "GATED": gated}
    ptx = _compile_sm90(f._fp8_gemv_kernel, signature, constexprs, num_warps=4, num_stages=2).asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert ("ex2.approx" in ptx) == gated
