"""The fused decode-step kernel (tests/gpu/test_fused_gpu.py's checks) on the CPU through
Triton's interpreter, at tiny shapes, against its torch reference: q/k RMSNorm + rotary +
store-KV (with and without the norm, an odd half width, 16-bit and FP8 caches, padding slots;
and against the unfused Triton kernels), and the decode attention kernel doing that work itself. Then it compiles for sm_90 here, so the GPU run meets
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
    "norm_rope_store_fp8_k_offset": ("check_qkv_rope_store", [6, 4, 2, 16, 16],
                                     {"qk_norm": True, "cache": "fp8_e4m3", "k_scale": 0.05, "k_offset": True}),
    "rope_store_v_key_major": ("check_qkv_rope_store", [6, 4, 2, 16, 16], {"v_key_major": True}),
    "norm_rope_store_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16],
                                   {"qk_norm": True}),
    "rope_store_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16], {}),
    "rope_store_fp8_vs_unfused": ("check_qkv_rope_store_equals_unfused_triton", [5, 4, 2, 16, 16],
                                  {"cache": "fp8_e4m3", "k_scale": 0.1, "v_scale": 0.2}),
    # the attention layers' wiring: fused vs unfused on a mixed batch (float32: the attention
    # kernels' dots, which the interpreter cannot run in 16 bits)
    "layer_llama": ("check_attention_layer_fused", ["llama"], {}),
    "layer_qwen3": ("check_attention_layer_fused", ["qwen3"], {}),
    "layer_llama_decodes": ("check_attention_layer_fused", ["llama"], {"decodes_only": True}),
    "layer_qwen3_decodes": ("check_attention_layer_fused", ["qwen3"], {"decodes_only": True}),
    # the decode kernel doing that work itself (PAGEDLLM_FUSED_ROPE_DECODE; test_decode_rope_gpu.py's
    # check): one split, split-K with
    # the reduce kernel, the last split merging with a window, the longest first and graph padding;
    # a head of 24 (an odd half, BLOCK_D 32)
    "decode_rope": ("check_decode_rope", [[1, 70, 17], 4, 2, 16, 16], {"num_splits": 1}),
    "decode_rope_batch_1": ("check_decode_rope", [[70], 4, 2, 16, 16], {"qk_norm": True, "num_splits": 2}),
    "decode_rope_norm_split_k": ("check_decode_rope", [[1, 70, 17], 4, 2, 16, 16],
                                 {"qk_norm": True, "num_splits": 3, "last_reduce": False}),
    "decode_rope_norm_last_reduce": ("check_decode_rope", [[1, 70, 17, 40], 8, 2, 16, 16],
                                     {"qk_norm": True, "num_splits": 4, "order": "desc", "last_reduce": True,
                                      "sliding_window": 20, "pad": 2}),
    "decode_rope_odd_half": ("check_decode_rope", [[5, 33], 4, 1, 24, 16], {"qk_norm": True, "num_splits": 2}),
    # each split's first tile loaded before the new key is made (PRELOAD): the new key inside the
    # first tile, at its end, in a later tile; a window; the reduce kernel and the last split
    "decode_rope_preload": ("check_decode_rope", [[1, 70, 17, 33], 4, 2, 16, 16],
                            {"qk_norm": True, "num_splits": 1, "preload": True}),
    "decode_rope_preload_splits": ("check_decode_rope", [[1, 70, 17, 40], 8, 2, 16, 16],
                                   {"num_splits": 3, "order": "desc", "last_reduce": True, "sliding_window": 20,
                                    "pad": 1, "preload": True}),
    "decode_rope_preload_reduce": ("check_decode_rope", [[70, 5], 4, 2, 16, 16],
                                   {"qk_norm": True, "num_splits": 2, "last_reduce": False, "preload": True}),
}
_DTYPES = ["float32", "float16", "bfloat16"]


def _keys():
    for name in _CASES:
        # (the layer and the decode kernel: attention's tl.dot, which the interpreter runs in float32
        # and float16 only)
        for dt in ["float32"] if name.startswith("layer_") else _DTYPES[:2] if name.startswith("decode_") else _DTYPES:
            yield f"{name}:{dt}"


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for check_file, decode in (("test_fused_gpu.py", False), ("test_decode_rope_gpu.py", True)):
        keys = [key for key in _keys() if key.startswith("decode_") == decode]
        results.update(run_under_interpreter(check_file, {key: _CASES[key.split(":")[0]] for key in keys}))
    return results


@pytest.mark.parametrize("key", list(_keys()))
def test_fused_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


@pytest.mark.parametrize("cache, k_offset", [("*bf16", False), ("*fp8e4nv", False), ("*fp8e4nv", True)])
@pytest.mark.parametrize("has_norm", [False, True])
def test_qkv_rope_store_compiles_for_sm90(cache, has_norm, k_offset):
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
    if k_offset:  # K stored less its offset (worker/kv_offset.py)
        signature["koff_ptr"] = "*fp32"
        constexprs["HAS_K_OFFSET"] = True
    compiled = _compile_sm90(r._qkv_rope_store_kernel, signature, constexprs, num_warps=2, num_stages=1)
    ptx = compiled.asm["ptx"]
    assert "st.global" in ptx
    if cache == "*fp8e4nv":
        assert "cvt.rn.satfinite.e4m3x2" in ptx  # two values per conversion into the cache


@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("split", [False, True])
def test_decode_rope_compiles_for_sm90(group, split):
    """The decode kernel with qkv_rope's work in it (ROPE, with and without the q/k norm) compiles
    for the H200 at the bf16 tiles, Llama-3.1-8B's group 4 and Qwen3-30B-A3B's 8, with its split
    merged by the last program or without splits: nothing spilled, no more registers than the
    kernel without it (the CTAs an SM holds), the new key and value stored."""
    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels import attention_merge as am
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, resources

    block_n, warps, stages = ad.DECODE_CONFIGS[2]
    got = {}
    for rope, norm in ((False, False), (True, False), (True, True)):
        constexprs = {"GROUP": group, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": block_n,
                      "BLOCK_D": 128, "SPLIT": split, "DOT_PRECISION": "tf32", "Q_AS_FP16": False, "SLIDING": False,
                      "SOFT_CAP": False, "ORDERED": False, "LAST_REDUCE": split, "BLOCK_S": am.MERGE_BLOCK_S,
                      "MERGE_UNROLL": am.MERGE_UNROLL, "V_T": False}
        signature = decode_signature("bf16")
        if rope:
            constexprs.update(ROPE=True, HAS_NORM=norm)
            signature.update(pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16",
                             slot_ptr="*i64", stride_cos="i32", stride_sin="i32", eps="fp32")
        compiled = compile_sm90(ad._decode_kernel, signature, constexprs, num_warps=warps, num_stages=stages,
                                aligned=DECODE_STRIDES)
        if rope:
            assert compiled.asm["ptx"].count("st.global") >= 2 + (not split)
        got[(rope, norm)] = resources(compiled)
        if got[(rope, norm)] is None:
            pytest.skip("Triton's cuobjdump is not there")
    plain = got[(False, False)]
    for key, r in got.items():
        assert r["stack"] == 0 and r["regs"] <= plain["regs"], (key, got)
    # PRELOAD (the first tile before the PDL wait, for grids of at most PRELOAD_MAX_WAVES programs an SM)
    # holds the tile across the wait: no spills, and three CTAs of 4 warps still fit an SM
    constexprs.update(PRELOAD=True, PDL=True)
    r = resources(compile_sm90(ad._decode_kernel, signature, constexprs, num_warps=warps, num_stages=stages,
                               aligned=DECODE_STRIDES))  # fmt: skip
    assert r["stack"] == 0 and 3 * r["regs"] * 32 * warps <= 65536, r
