"""The fused decode-step kernel (tests/gpu/test_fused_gpu.py's checks) on the CPU through
Triton's interpreter, at tiny shapes, against its torch reference: q/k RMSNorm + rotary +
store-KV (with and without the norm, an odd half width, 16-bit and FP8 caches, padding slots;
and against the unfused Triton kernels). Then it compiles for sm_90 here, so the GPU run meets
no compile error."""

from __future__ import annotations

import importlib.util

import pytest
from test_fp8_interpret import _compile_sm90
from test_kernels_interpret import run_under_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_CASES = {
    "rope_store": ("check_qkv_rope_store", [5, 4, 2, 16, 16], {}),
    "norm_rope_store": ("check_qkv_rope_store", [5, 4, 2, 16, 16], {"qk_norm": True}),
    "norm_rope_store_odd_half": ("check_qkv_rope_store", [4, 3, 1, 24, 16], {"qk_norm": True, "block_h": 2}),
    "norm_rope_store_fp8": ("check_qkv_rope_store", [6, 4, 2, 16, 16],
                            {"qk_norm": True, "cache": "fp8_e4m3", "k_scale": 0.05, "v_scale": 0.3}),
    "rope_store_e5m2": ("check_qkv_rope_store", [6, 4, 2, 16, 16], {"cache": "fp8_e5m2", "k_scale": 0.5}),
    "rope_store_v_key_major": ("check_qkv_rope_store", [6, 4, 2, 16, 16], {"v_key_major": True}),
    "norm_rope_store_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16],
                                   {"qk_norm": True}),
    "rope_store_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16], {}),
    "rope_store_fp8_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16],
                                  {"cache": "fp8_e4m3", "k_scale": 0.1, "v_scale": 0.2}),
    # the qkv product with the rope/store in its epilogue: one split (head tiles of 16), split-K
    # (the last program of a head's tile), the stream normalized in the prologue or not, bias, an
    # FP8 cache with scales, q/k norm or none, 1 and 5 tokens (padding slots among them)
    "qkv_gemm_rope": ("check_qkv_gemm_rope", [5, 48, 4, 2, 16, 16], {"qk_norm": True, "config": [16, 16, 1, 4, 1]}),
    "qkv_gemm_rope_split_bias": ("check_qkv_gemm_rope", [1, 64, 4, 2, 16, 16],
                                 {"bias": True, "norm": False, "config": [16, 16, 2, 4, 1]}),
    "qkv_gemm_rope_fp8_split3": ("check_qkv_gemm_rope", [5, 48, 4, 2, 16, 16],
                                 {"qk_norm": True, "cache": "fp8_e4m3", "k_scale": 0.5, "v_scale": 2.0,
                                  "config": [16, 16, 3, 4, 1]}),
    # the attention layers' wiring: fused vs unfused on a mixed batch (float32: the attention
    # kernels' dots, which the interpreter cannot run in 16 bits)
    "layer_llama": ("check_attention_layer_fused", ["llama"], {}),
    "layer_stream_llama": ("check_attention_layer_stream", ["llama"], {}),
    "layer_stream_qwen3": ("check_attention_layer_stream", ["qwen3"], {}),
    "layer_qwen3": ("check_attention_layer_fused", ["qwen3"], {}),
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
    if cache == "*fp8e4nv":  # FP8 V blocks are stored key-major: head_dim at stride block_size (bf16: 1)
        signature["stride_vcd"] = "i32"
    signature.update(dict.fromkeys(["eps", "inv_k_scale", "inv_v_scale"], "fp32"))
    constexprs = {"HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 4, "BLOCK_SIZE": 16,
                  **({} if cache == "*fp8e4nv" else {"stride_vcd": 1}),
                  "HAS_NORM": has_norm, "FP8_MAX": 448.0 if cache == "*fp8e4nv" else 0.0}
    compiled = _compile_sm90(r._qkv_rope_store_kernel, signature, constexprs, num_warps=2, num_stages=1)
    ptx = compiled.asm["ptx"]
    assert "st.global" in ptx
    if cache == "*fp8e4nv":
        assert "cvt.rn.satfinite.e4m3x2" in ptx  # two values per conversion into the cache


@pytest.mark.parametrize("split_k, cache", [(1, "*bf16"), (2, "*bf16"), (2, "*fp8e4nv")])
def test_qkv_gemm_rope_compiles_for_sm90(split_k, cache):
    """The qkv product with the rope/store epilogue at Qwen3-30B-A3B's shape (head tiles of 128,
    its input normalized, q/k norms) compiles for the H200: the product on the tensor cores with
    pipelined loads, nothing spilled; split, the counting protocol of a last-program reduce."""
    from test_pdl_interpret import qkv_gemm_signature
    from test_small_m_interpret import check_last_program_ptx

    from pagedllm.kernels import qkv_gemm_rope_triton as q
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    signature = dict(qkv_gemm_signature(), k_cache_ptr=cache, v_cache_ptr=cache)
    constexprs = {"HAS_BIAS": False, "NORM": True, "BLOCK_KN": 2048, "NORM_ROWS": 4, "EVEN_K": True, "SPLIT_K": split_k,
                  "BLOCK_M": 16, "BLOCK_K": 128, "HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_SIZE": 16,
                  "HAS_QK_NORM": True, "FP8_MAX": 448.0 if cache == "*fp8e4nv" else 0.0, "V_MAX": 0.0}
    compiled = compile_sm90(q._swap_qkv_rope_kernel, signature, constexprs, num_warps=4, num_stages=3,
                            aligned=("N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_qkv"))
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    if split_k > 1:
        check_last_program_ptx(ptx)
    r = resources(compiled)
    if r is not None:
        assert r["stack"] == 0, r
