"""The FP8 kernels (tests/gpu/test_fp8_gpu.py's checks) on the CPU through Triton's interpreter, at
small shapes, against their torch references: the W8A16 GEMV and tensor-core GEMM (per-channel and
K-group scales, ragged shapes, bias), the swap-AB tensor-core kernel for few rows (split-K too), the
per-token quantization (alone and in the gated activation's and RMSNorm's kernels), and the
attention kernels on e4m3 / e5m2 KV caches with scales. bfloat16 through `tl.dot` does not run in
the interpreter (test_kernels_interpret.py says why): float32 and float16 activations here, and
bfloat16 for the swap-AB kernel, whose dots take fp16 operands (its saturation of bfloat16 values
beyond fp16's range is checked there too)."""

from __future__ import annotations

import importlib.util

import pytest
from test_kernels_interpret import run_under_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_GEMV = ["gemv", 1, 8, 32, 4, 1]
_GEMV_UNROLLED = ["gemv_unrolled", 1, 8, 32, 4, 1, 2]
_DOT = ["dot", 16, 16, 32, 4, 1]
_SWAP = ["swap", 16, 16, 32, 4, 1]
_SWAP_SPLIT = ["swap", 16, 16, 32, 4, 1, 3]
_MIXED = {"query_lens": [1, 1, 6, 18], "seq_lens": [9, 30, 6, 40], "num_decodes": 2,
          "hq": 4, "hkv": 2, "head_dim": 16, "block_size": 16}
_CASES = {
    "gemv_channel": ("check_fp8_gemm", [1, 40, 72], {"config": _GEMV}),
    "gemv_rows_bias": ("check_fp8_gemm", [3, 40, 64], {"bias": True, "config": _GEMV}),
    "gemv_groups": ("check_fp8_gemm", [2, 24, 96], {"group_k": 32, "config": _GEMV}),
    "gemv_unrolled_channel": ("check_fp8_gemm", [1, 40, 128], {"config": _GEMV_UNROLLED}),
    "gemv_unrolled_rows_bias_groups": ("check_fp8_gemm", [2, 24, 192], {"group_k": 32, "bias": True,
                                                                         "config": _GEMV_UNROLLED}),
    "dot_channel": ("check_fp8_gemm", [17, 40, 72], {"config": _DOT}),
    "dot_groups_bias": ("check_fp8_gemm", [20, 24, 96], {"group_k": 32, "bias": True, "config": _DOT}),
    "swap_channel": ("check_fp8_gemm", [1, 40, 72], {"config": _SWAP}),
    "swap_rows_bias": ("check_fp8_gemm", [16, 40, 64], {"bias": True, "config": _SWAP}),
    "swap_groups": ("check_fp8_gemm", [5, 24, 96], {"group_k": 32, "config": _SWAP}),
    "swap_split_k": ("check_fp8_gemm", [3, 40, 200], {"bias": True, "config": _SWAP_SPLIT}),
    "swap_split_k_groups": ("check_fp8_gemm", [7, 24, 192], {"group_k": 32, "config": _SWAP_SPLIT}),
    # three splits of 128 over 320 inputs (steps of 32): the last split's steps past K read no scale
    "swap_split_k_past_the_end": ("check_fp8_gemm", [3, 24, 320], {"group_k": 32, "config": _SWAP_SPLIT,
                                                                  "nan_past_end": True}),
    "swap_fp16_saturation": ("check_fp16_saturation", [_SWAP], {}),
    "per_token_quant": ("check_per_token_quant", [5, 40], {}),
    "act_and_mul_fp8": ("check_act_and_mul_fp8", [5, 40], {}),
    "gelu_and_mul_fp8_ragged": ("check_act_and_mul_fp8", [3, 37], {"gelu_tanh": True}),
    "rms_norm_fp8_residual": ("check_rms_norm_fp8", [4, 48], {}),
    "rms_norm_fp8_ragged": ("check_rms_norm_fp8", [3, 40], {"residual": False}),
    "kv_e4m3_scaled": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e4m3", k_scale=0.05, v_scale=0.3)),
    "kv_e4m3_split_k": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e4m3", num_splits=3)),
    "kv_e5m2": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e5m2", k_scale=0.5, v_scale=2.0)),
    "kv_reference_semantics": ("check_fp8_reference", [], dict(_MIXED, cache="fp8_e4m3", k_scale=0.5, v_scale=2.0)),
    # the engine keeps FP8 V blocks key-major (attention/backend.py); the kernels' other path, a
    # contiguous V, and the key-major one with 32-token blocks, a NaN stored as 0, a window + cap
    "kv_e4m3_v_contiguous": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e4m3", num_splits=3,
                                                           v_contiguous=True)),
    "kv_e4m3_bs32_nan": ("check_fp8_backend", [], dict(_MIXED, block_size=32, cache="fp8_e4m3", v_scale=0.3,
                                                       nan_token=True)),
    "kv_e4m3_window_softcap": ("check_fp8_backend", [], dict(_MIXED, cache="fp8_e4m3", num_splits=3,
                                                             sliding_window=12, logits_soft_cap=2.0)),
    # the decode kernels alone on FP8 caches (seq_lens, hq, hkv, head_dim, block_size)
    "decode_e4m3": ("check_fp8_decode", [[1, 40, 9, 70], 4, 2, 16, 16], {"k_scale": 0.05, "v_scale": 0.3,
                                                                      "num_splits": 2}),
    "decode_e5m2_group4_split_k": ("check_fp8_decode", [[1, 40, 9, 70], 8, 2, 16, 16],
                                   {"cache": "fp8_e5m2", "k_scale": 0.5, "v_scale": 2.0, "num_splits": 3}),
    # a window not starting on a block boundary: the splits start on one, the keys below masked
    "decode_e4m3_window_last_reduce": ("check_fp8_decode", [[1, 40, 9, 70], 4, 2, 16, 16],
                                       {"sliding_window": 21, "num_splits": 3, "last_reduce": True}),
    "decode_e4m3_v_contiguous": ("check_fp8_decode", [[1, 40, 9, 70], 4, 2, 16, 16],
                                 {"num_splits": 2, "v_contiguous": True}),
}
_DTYPES = ["float32", "float16"]


def _keys():
    for name in _CASES:
        if name == "swap_fp16_saturation":
            yield f"{name}:bfloat16"
            continue
        for dt in _DTYPES + (["bfloat16"] if name.startswith("swap") else []):
            yield f"{name}:{dt}"


def _positional(case):
    fn, args, kwargs = case
    if fn in ("check_fp8_backend", "check_fp8_reference"):  # its batch arguments are given by name
        mixed = {k: kwargs[k] for k in _MIXED}
        rest = {k: v for k, v in kwargs.items() if k not in _MIXED}
        return fn, [mixed[k] for k in _MIXED] + args, rest
    return fn, args, kwargs


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    cases = {key: _positional(_CASES[key.split(":")[0]]) for key in _keys()}
    return run_under_interpreter("test_fp8_gpu.py", cases)


@pytest.mark.parametrize("key", list(_keys()))
def test_fp8_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


def _compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    """`kernel` compiled for sm_90 here (pagedllm/kernels/inspect_sm90.py), with the GEMM kernels'
    sizes and row strides marked 16-divisible as a real launch marks them."""
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    return compile_sm90(kernel, signature, constexprs, num_warps, num_stages,
                        aligned=("N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om"))


@pytest.mark.parametrize("block_n, split_k", [(64, 4), (128, 1)])
def test_swap_kernel_compiles_for_sm90(block_n, split_k):
    """The swap-AB kernel compiles for the H200 (Triton errors the interpreter cannot show), its
    e4m3 -> fp16 conversion is the paired instruction, its weight loads are asynchronous copies
    (pipelined), and its products run on Hopper's tensor cores (wgmma)."""
    from test_small_m_interpret import swap_constexprs, swap_signature

    from pagedllm.kernels import swap_gemm_triton as s

    signature = swap_signature("*bf16" if split_k == 1 else "*fp32", weight="*fp8e4nv", scale="*fp32")
    constexprs = swap_constexprs(split_k, block_n, 128, SCALED=True, HAS_BIAS=False, OPERANDS="fp16")
    compiled = _compile_sm90(s._swap_kernel, signature, constexprs, num_warps=4, num_stages=3)
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.f32.f16" not in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async" in ptx


def test_gemv_kernel_compiles_for_sm90():
    """The one-row GEMV compiles for the H200 and converts e4m3 -> fp16 two values at a time."""
    from pagedllm.kernels import fp8_triton as f

    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16",
                 "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}
    constexprs = {"GROUP_K": 0, "HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": 8, "BLOCK_K": 256}
    ptx = _compile_sm90(f._fp8_gemv_kernel, signature, constexprs, num_warps=4, num_stages=2).asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_ordered_decode_grid_costs_no_registers(cache):
    """The longest-first decode order (PAGEDLLM_DECODE_ORDER) compiles for the H200 at the default
    tiles with as many CTAs per SM as the plain grid: the order's (kv head, request) both stay
    program ids (one linear id decoded by division cost 18 registers, one CTA less per SM)."""
    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, resources

    block_n, warps, stages = ad.DECODE_CONFIGS[2 if cache == "bf16" else 1]
    regs = {}
    for ordered in (False, True):
        constexprs = {"GROUP": 2, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": block_n,
                      "BLOCK_D": 128, "SPLIT": False, "DOT_PRECISION": "tf32", "Q_AS_FP16": cache != "bf16",
                      "SLIDING": False, "SOFT_CAP": False, "ORDERED": ordered, "LAST_REDUCE": False,
                      "BLOCK_S": 16, "MERGE_UNROLL": 4, "V_T": cache != "bf16"}
        compiled = compile_sm90(ad._decode_kernel, decode_signature(cache), constexprs, num_warps=warps,
                                num_stages=stages, aligned=DECODE_STRIDES)
        r = resources(compiled)
        if r is None:
            pytest.skip("Triton's cuobjdump is not there")
        regs[ordered] = r["regs"]
    # what registers decide: the CTAs an SM holds (64K registers; 126 against 124 for FP8 here)
    per_sm = {k: 65536 // (v * 32 * warps) for k, v in regs.items()}
    assert per_sm[True] >= per_sm[False], (regs, per_sm)


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("ordered", [False, True])
def test_decode_last_reduce_compiles_for_narrow_heads(head_dim, ordered):
    """The merge compiles for sm_90 at the narrowest heads the rule lets it run at
    (attention_merge.LAST_REDUCE_MIN_BLOCK_D; at 16 Triton 3.6 asserts), with the pointers'
    alignment hints a launch gives (without them the 16-wide variant compiled too)."""
    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels import attention_merge as am
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature

    assert head_dim >= am.LAST_REDUCE_MIN_BLOCK_D
    constexprs = {"GROUP": 4, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": head_dim,
                  "SPLIT": True, "DOT_PRECISION": "tf32", "Q_AS_FP16": False, "SLIDING": False, "SOFT_CAP": False,
                  "ORDERED": ordered, "LAST_REDUCE": True, "BLOCK_S": am.MERGE_BLOCK_S,
                  "MERGE_UNROLL": am.MERGE_UNROLL}
    compile_sm90(ad._decode_kernel, decode_signature("bf16"), constexprs, num_warps=4, num_stages=2,
                 aligned=DECODE_STRIDES)


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("group", [4, 8])
def test_decode_last_reduce_compiles_for_sm90(cache, group):
    """The decode kernel whose last split merges the splits (PAGEDLLM_DECODE_LAST_REDUCE) compiles
    for the H200 at the default tiles with the counting protocol in its PTX: the partials' stores,
    a barrier, the acq_rel gpu-scope count, the partials read back from the L2. Llama-3.1-8B's
    group 4 and Qwen3-30B-A3B's 8, each cache in the engine's layout (FP8: V blocks key-major).
    For bf16 caches: nothing spilled, and no more registers than the kernel without splits (the
    merge runs after the main loop; 86-96 here against 95-96)."""
    from test_small_m_interpret import check_last_program_ptx

    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels import attention_merge as am
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, resources

    block_n, warps, stages = ad.DECODE_CONFIGS[2 if cache == "bf16" else 1]
    regs = {}
    for split, last in ((False, False), (True, True)):
        constexprs = {"GROUP": group, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": block_n,
                      "BLOCK_D": 128, "SPLIT": split, "DOT_PRECISION": "tf32", "Q_AS_FP16": cache != "bf16",
                      "SLIDING": False, "SOFT_CAP": False, "ORDERED": False, "LAST_REDUCE": last,
                      "BLOCK_S": am.MERGE_BLOCK_S, "MERGE_UNROLL": am.MERGE_UNROLL, "V_T": cache != "bf16"}
        compiled = compile_sm90(ad._decode_kernel, decode_signature(cache), constexprs, num_warps=warps,
                                num_stages=stages, aligned=DECODE_STRIDES)
        if last:
            check_last_program_ptx(compiled.asm["ptx"])
        r = resources(compiled)
        if r is None:
            pytest.skip("Triton's cuobjdump is not there")
        regs[last] = r
    if cache == "bf16":
        assert regs[True]["stack"] == 0, regs
        assert regs[True]["regs"] <= regs[False]["regs"], regs


@pytest.mark.parametrize("group", [2, 4, 8])
def test_fp8_decode_reads_key_major_v_without_byte_loads(group):
    """The FP8 decode kernel at its default tiles, compiled for the H200: with V blocks stored
    key-major (the engine's FP8 layout) the P.V operand comes out of shared memory in words,
    and the kernel needs about half the registers (128 here; 254 with V head_dim-major, whose
    operand is gathered a byte at a time: 128 ld.shared.u8 a thread a tile)."""
    import re

    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, resources

    block_n, warps, stages = ad.DECODE_CONFIGS[1]
    got = {}
    for v_t in (False, True):
        constexprs = {"GROUP": group, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": block_n,
                      "BLOCK_D": 128, "SPLIT": True, "DOT_PRECISION": "tf32", "Q_AS_FP16": True, "SLIDING": False,
                      "SOFT_CAP": False, "ORDERED": False, "LAST_REDUCE": False, "V_T": v_t}
        compiled = compile_sm90(ad._decode_kernel, decode_signature("fp8e4nv"), constexprs, num_warps=warps,
                                num_stages=stages, aligned=DECODE_STRIDES)
        r = resources(compiled)
        if r is None:
            pytest.skip("Triton's cuobjdump is not there")
        bytes_loads = len(re.findall(r"ld\.shared(?:\.v\d)?\.[usb]8", compiled.asm["ptx"]))
        got[v_t] = (bytes_loads, r["regs"], r["stack"])
    assert got[False][0] > 0, got  # the check sees the byte gathers where they are
    assert got[True][0] == 0 and got[True][2] == 0, got
    assert got[True][1] <= 0.6 * got[False][1], got


@pytest.mark.parametrize("maxnreg", [96, 104])
def test_fp8_decode_under_a_register_cap(maxnreg):
    """PAGEDLLM_DECODE_CONFIG's fourth field (ptxas maxnreg): the FP8 decode kernel at its default
    tiles (V key-major, longest first) compiled for the H200 within the cap, and at 96 five CTAs an
    SM by both registers and shared memory (four by ptxas's own choice). Spills: none at 104; at 96
    none with Triton 3.6 (the device's), 32 bytes with 3.9 (this machine's)."""
    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, resources

    block_n, warps, stages = ad.DECODE_CONFIGS[1]
    constexprs = {"GROUP": 2, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": block_n, "BLOCK_D": 128,
                  "SPLIT": True, "DOT_PRECISION": "tf32", "Q_AS_FP16": True, "SLIDING": False, "SOFT_CAP": False,
                  "ORDERED": True, "LAST_REDUCE": False, "V_T": True}
    compiled = compile_sm90(ad._decode_kernel, decode_signature("fp8e4nv"), constexprs, num_warps=warps,
                            num_stages=stages, aligned=DECODE_STRIDES, maxnreg=maxnreg)
    r = resources(compiled)
    if r is None:
        pytest.skip("Triton's cuobjdump is not there")
    assert r["regs"] <= maxnreg and r["stack"] <= (32 if maxnreg == 96 else 0), r
    if maxnreg == 96:
        threads = warps * 32
        assert 65536 // (r["regs"] * threads) >= 5 and 5 * r["shared"] <= 227 * 1024, r
