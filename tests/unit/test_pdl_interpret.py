"""Programmatic dependent launch (PAGEDLLM_PDL, kernels/pdl_triton.py) in every kernel that has the
switch, compiled for the H200 (sm_90) on this machine: with PDL each kernel's PTX lets the next
kernel launch and waits for the one before it, and nothing is stored, counted or read from an
earlier kernel before that wait (the rule that makes an early start safe); with
PAGEDLLM_PDL=prefetch the GEMVs ask L2 for their first weight tiles before it; without PDL the
kernels are as before. The switch's parsing and its refusal on the CPU run here too; the GPU tests
(tests/gpu/test_pdl_gpu.py) run the kernels."""

from __future__ import annotations

import re

import pytest
from test_kernels_interpret import pytestmark  # noqa: F401  (skips without triton)

_FLOATS = {"eps", "qk_scale", "v_scale", "soft_cap", "inv_k_scale", "inv_v_scale"}


def _signature(kernel, **types) -> dict:
    """The kernel's runtime arguments in parameter order: `types` where given, else a pointer
    to bf16 for *_ptr, float32 for the scales and eps, int32 for the rest."""
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            continue
        sig[p.name] = types.get(p.name) or ("*bf16" if p.name.endswith("_ptr") else
                                            "fp32" if p.name in _FLOATS else "i32")
    return sig


def _cases():
    """(name, kernel, signature, constexprs, num_warps, what may be read before the wait: True any
    load (weights), "inputs" only loads through the L2 (.cg: the step's inputs and tables, which no
    kernel of the step writes), False nothing)."""
    from test_fused_moe_interpret import _DOWN_SIG, _GATE_UP_SIG, _down_constexprs
    from test_small_m_interpret import swap_constexprs, swap_signature

    from pagedllm.kernels import (
        activation_triton,
        attention_decode,
        attention_merge,
        fp8_triton,
        fused_moe_small_triton,
        norm_triton,
        qkv_rope_triton,
        swap_gemm_triton,
        wna16_triton,
    )

    fp8_gemv = _signature(fp8_triton._fp8_gemv_kernel, w_ptr="*fp8e4nv", s_ptr="*fp32")

    def wna16_sig(kernel):
        return _signature(kernel, w_ptr="*i32", out_ptr="*fp32", ws_ptr="*fp32", count_ptr="*i32")
    decode = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128,
              "SPLIT": True, "DOT_PRECISION": "tf32", "Q_AS_FP16": False}
    return [
        ("rms_norm", norm_triton._rms_norm_kernel, _signature(norm_triton._rms_norm_kernel),
         {"HAS_RESIDUAL": True, "BLOCK": 1024}, 2, True),
        ("act_and_mul", activation_triton._act_and_mul_kernel, _signature(activation_triton._act_and_mul_kernel),
         {"BLOCK": 1024, "GELU_TANH": False}, 4, False),
        ("qkv_rope", qkv_rope_triton._qkv_rope_store_kernel,
         _signature(qkv_rope_triton._qkv_rope_store_kernel, pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
                    slot_ptr="*i64"),
         {"HEAD_DIM": 128, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_H": 4, "BLOCK_SIZE": 16, "HAS_NORM": True,
          "FP8_MAX": 0.0}, 2, "inputs"),
        ("decode", attention_decode._decode_kernel,
         _signature(attention_decode._decode_kernel, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    order_ptr="*i32", part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32",
                    count_ptr="*i32"), decode, 4, "inputs"),
        ("decode_last_ordered", attention_decode._decode_kernel,
         _signature(attention_decode._decode_kernel, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    order_ptr="*i32", part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32",
                    count_ptr="*i32"),
         {**decode, "ORDERED": True, "LAST_REDUCE": True, "BLOCK_S": attention_merge.MERGE_BLOCK_S,
          "MERGE_UNROLL": attention_merge.MERGE_UNROLL}, 4, "inputs"),
        ("decode_reduce", attention_merge._decode_reduce_kernel,
         _signature(attention_merge._decode_reduce_kernel, part_out_ptr="*fp32", part_max_ptr="*fp32",
                    part_sum_ptr="*fp32"), {"HEAD_DIM": 128, "BLOCK_S": 64, "BLOCK_D": 128}, 4, False),
        ("swap", swap_gemm_triton._swap_kernel, swap_signature("*fp32"),
         swap_constexprs(4, 64, 128, PREFETCH_K=256), 4, True),
        ("swap_last", swap_gemm_triton._swap_kernel, swap_signature("*bf16"),
         swap_constexprs(4, 64, 128, LAST=True), 4, False),
        ("swap_router_prefetch", swap_gemm_triton._swap_kernel, swap_signature("*fp32"),
         swap_constexprs(8, 64, 128, HAS_BIAS=False, TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8,
                         PREFETCH_K=256), 4, True),
        ("swap_fp8_prefetch", swap_gemm_triton._swap_kernel,
         swap_signature("*bf16", weight="*fp8e4nv", scale="*fp32"),
         swap_constexprs(1, 64, 128, SCALED=True, HAS_BIAS=False, OPERANDS="fp16", PREFETCH_K=256), 4, True),
        ("splitk_reduce", swap_gemm_triton._splitk_reduce_kernel,
         _signature(swap_gemm_triton._splitk_reduce_kernel, ws_ptr="*fp32"),
         {"SPLIT_K": 4, "SCALED": False, "GROUP_K": 0, "HAS_BIAS": True, "BLOCK": 1024}, 4, False),
        ("fp8_gemv", fp8_triton._fp8_gemv_kernel, fp8_gemv,
         {"GROUP_K": 0, "HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": 8, "BLOCK_K": 256, "PREFETCH_K": 512}, 4,
         True),
        ("fp8_gemv_unrolled", fp8_triton._fp8_gemv_unrolled_kernel, fp8_gemv,
         {"GROUP_K": 0, "HAS_BIAS": False, "BLOCK_N": 32, "BLOCK_K": 256, "UNROLL": 2, "PREFETCH_K": 512}, 4,
         True),
        ("fp8_gemv_blocks", fp8_triton._fp8_gemv_kernel, fp8_gemv,
         {"GROUP_K": 128, "HAS_BIAS": True, "EVEN_K": True, "BLOCK_N": 16, "BLOCK_K": 128, "PREFETCH_K": 256}, 4,
         True),
        ("moe_gate_up", fused_moe_small_triton._small_gate_up_kernel, _GATE_UP_SIG,
         {"HAS_MAP": True, "HAS_LOAD": True, "HAS_SLOTS": True, "EVEN_K": True, "DOT_PRECISION": "tf32",
          "BLOCK_N": 64, "BLOCK_K": 128, "PAD_COLS": 16}, 4, False),
        ("moe_down", fused_moe_small_triton._small_down_kernel, _DOWN_SIG,
         {"HAS_MAP": True, "EVEN_K": True, "DOT_PRECISION": "tf32", **_down_constexprs((64, 128, 4, 3, 1)),
          "BLOCK_N": 64, "BLOCK_K": 128, "PAD_COLS": 16}, 4, False),
        # PAGEDLLM_MOE_PRELOAD (on by default): gate/up releases the down kernel after its wait; the down
        # kernel reads the routing (through L2), the expert map (a table) and its first weight tile before its own
        ("moe_gate_up_release_late", fused_moe_small_triton._small_gate_up_kernel, _GATE_UP_SIG,
         {"HAS_MAP": True, "HAS_LOAD": True, "HAS_SLOTS": True, "EVEN_K": True, "DOT_PRECISION": "tf32",
          "BLOCK_N": 64, "BLOCK_K": 128, "PAD_COLS": 16, "RELEASE_LATE": True}, 4, False),
        ("moe_down_preload", fused_moe_small_triton._small_down_kernel, _DOWN_SIG,
         {"HAS_MAP": True, "EVEN_K": True, "DOT_PRECISION": "tf32", **_down_constexprs((64, 128, 4, 3, 1)),
          "BLOCK_N": 64, "BLOCK_K": 128, "PAD_COLS": 16, "PRELOAD": True}, 4, True),
        ("wna16_gemv", wna16_triton._wna16_gemv_kernel, wna16_sig(wna16_triton._wna16_gemv_kernel),
         {"BITS": 4, "GROUP_K": 128, "HAS_ZERO": False, "HAS_BIAS": False, "SPLIT_K": 1, "EVEN": True,
          "BLOCK_N": 128, "BLOCK_KW": 16}, 4, False),
        ("wna16_gemvp_split_last", wna16_triton._wna16_gemv_packed_kernel,
         wna16_sig(wna16_triton._wna16_gemv_packed_kernel),
         {"GROUP_K": 128, "HAS_ZERO": True, "HAS_BIAS": False, "SPLIT_K": 4, "LAST": True, "EVEN": True,
          "BLOCK_N": 32, "BLOCK_KW": 64}, 4, False),
        # PAGEDLLM_WNA16_PDL=1: the first tile's words (weights) before the wait, through L2
        ("wna16_gemvp_prefetch", wna16_triton._wna16_gemv_packed_kernel,
         wna16_sig(wna16_triton._wna16_gemv_packed_kernel),
         {"GROUP_K": 128, "HAS_ZERO": True, "HAS_BIAS": False, "SPLIT_K": 1, "EVEN": True, "PREFETCH": True,
          "BLOCK_N": 32, "BLOCK_KW": 128}, 8, "inputs"),
        # the decode kernel doing qkv_rope's work, its first tile of keys and values before the wait
        ("decode_rope_preload", attention_decode._decode_kernel,
         _signature(attention_decode._decode_kernel, block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    order_ptr="*i32", part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32",
                    count_ptr="*i32", pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64"),
         {**decode, "LAST_REDUCE": True, "BLOCK_S": attention_merge.MERGE_BLOCK_S,
          "MERGE_UNROLL": attention_merge.MERGE_UNROLL, "ROPE": True, "HAS_NORM": True, "PRELOAD": True}, 4,
         "inputs"),
        # an FP8 cache as the engine lays it out: V blocks key-major
        ("decode_fp8_key_major", attention_decode._decode_kernel,
         _signature(attention_decode._decode_kernel, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
                    block_tables_ptr="*i32", seq_lens_ptr="*i32", order_ptr="*i32", part_out_ptr="*fp32",
                    part_max_ptr="*fp32", part_sum_ptr="*fp32", count_ptr="*i32"),
         {**decode, "BLOCK_N": 128, "Q_AS_FP16": True, "V_T": True}, 4, "inputs"),
    ]


CASES = ["rms_norm", "act_and_mul", "qkv_rope", "decode", "decode_last_ordered", "decode_reduce", "swap",
         "swap_last", "swap_router_prefetch", "swap_fp8_prefetch", "splitk_reduce", "fp8_gemv", "fp8_gemv_unrolled",
         "fp8_gemv_blocks", "moe_gate_up", "moe_down", "moe_gate_up_release_late", "moe_down_preload", "wna16_gemv",
         "wna16_gemvp_split_last", "wna16_gemvp_prefetch",
         "decode_rope_preload", "decode_fp8_key_major"]


@pytest.mark.parametrize("name", CASES)
def test_pdl_kernel_waits_before_it_touches_data(name):
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    _, kernel, signature, constexprs, warps, reads_first = next(c for c in _cases() if c[0] == name)
    ptx = compile_sm90(kernel, signature, {**constexprs, "PDL": True}, num_warps=warps, num_stages=2).asm["ptx"]
    assert "griddepcontrol.launch_dependents" in ptx, "the next kernel is never released"
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0, "no wait for the kernel before"
    first_write = re.search(r"\b(st\.global|atom\.|red\.|cp\.async\.bulk\.global)", ptx)
    assert first_write is not None and first_write.start() > wait, "a store or count before the wait"
    loads_before = re.findall(r"\b(ld\.global[.\w]*|cp\.async\.(?:cg|ca))", ptx[:wait])
    if reads_first == "inputs":
        assert loads_before, "the step's inputs are not read before the wait"
        assert all(".cg" in op for op in loads_before), f"{loads_before}: a load before the wait not through L2"
        after = re.findall(r"\b(ld\.global[.\w]*|cp\.async\.(?:cg|ca))", ptx[wait:])
        assert any(".cg" not in op or op.startswith("cp.async") for op in after), "no data read after the wait"
    elif not reads_first:
        assert not loads_before, f"{len(loads_before)} loads before the wait"
    prefetch = ptx.find("cp.async.bulk.prefetch.L2")
    if constexprs.get("PREFETCH_K", 0) > 0:
        assert 0 <= prefetch < wait, "the weight prefetch is not issued before the wait"
    else:
        assert prefetch < 0


@pytest.mark.parametrize("preload", [False, True])
def test_decode_preload_loads_its_tile_before_the_wait(preload):
    """The decode kernel with ROPE: PRELOAD takes the split's first tile of keys and values (16-byte
    loads through L2) before the PDL wait; without it nothing but the step's inputs comes first.
    The earlier steps stored those keys (pdl_triton's rule 1 exception); the step's own key, which
    this kernel stores after the wait, replaces its stale row in registers (test_fused_interpret's
    decode_rope_preload cases, whose caches hold random values in the new keys' slots)."""
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90

    _, kernel, signature, constexprs, warps, _ = next(c for c in _cases() if c[0] == "decode_rope_preload")
    ptx = compile_sm90(kernel, signature, {**constexprs, "PDL": True, "PRELOAD": preload}, num_warps=warps,
                       num_stages=2, aligned=DECODE_STRIDES).asm["ptx"]  # fmt: skip
    wait = ptx.find("griddepcontrol.wait")
    tiles = [m.start() for m in re.finditer(r"ld\.global\.cg\.v4", ptx)]
    assert any(t < wait for t in tiles) == preload, (preload, len(tiles))


def test_without_pdl_the_kernel_is_unchanged():
    """PDL False (the default) compiles no grid dependency control and no prefetch."""
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    _, kernel, signature, constexprs, warps, _ = next(c for c in _cases() if c[0] == "fp8_gemv")
    constexprs = {**constexprs, "PREFETCH_K": 0}
    ptx = compile_sm90(kernel, signature, constexprs, num_warps=warps, num_stages=2).asm["ptx"]
    assert "griddepcontrol" not in ptx and "prefetch" not in ptx


def test_pdl_switch(monkeypatch):
    """PAGEDLLM_PDL: 1 by default, 0 or prefetch; anything else a ValueError naming it; on a CPU
    tensor always off (the launch as before); PREFETCH_K only with prefetch and aligned rows."""
    import torch

    from pagedllm.kernels import _triton

    for value, mode in (("", "1"), ("0", "0"), ("1", "1"), ("prefetch", "prefetch")):
        monkeypatch.setenv("PAGEDLLM_PDL", value)
        _triton._pdl_mode.cache_clear()
        assert _triton._pdl_mode() == mode
        assert _triton.pdl(torch.zeros(2)) == {"PDL": False}
        assert _triton.pdl_weights(torch.zeros(2), torch.zeros(4, 8), 128) == {"PDL": False}
    monkeypatch.setenv("PAGEDLLM_PDL", "yes")
    _triton._pdl_mode.cache_clear()
    with pytest.raises(ValueError, match="PAGEDLLM_PDL"):
        _triton._pdl_mode()
    _triton._pdl_mode.cache_clear()


def test_moe_preload_orders():
    """PAGEDLLM_MOE_PRELOAD's two halves compiled for the H200: the gate/up kernel releases the next
    kernel only after its wait (so the routing is written when the down kernel starts); the down
    kernel reads the routing through the L2 and loads its first weight tile (128-bit loads) before its
    wait, and reads h only after it."""
    from test_fused_moe_interpret import _ALIGNED

    from pagedllm.kernels.inspect_sm90 import compile_sm90

    cases = {c[0]: c for c in _cases()}
    _, kernel, signature, constexprs, warps, _ = cases["moe_gate_up_release_late"]
    ptx = compile_sm90(kernel, signature, {**constexprs, "PDL": True}, num_warps=warps, num_stages=2).asm["ptx"]
    assert 0 <= ptx.find("griddepcontrol.wait") < ptx.find("griddepcontrol.launch_dependents")
    _, kernel, signature, constexprs, warps, _ = cases["moe_down_preload"]
    ptx = compile_sm90(kernel, signature, {**constexprs, "PDL": True}, num_warps=warps, num_stages=3,
                       aligned=_ALIGNED).asm["ptx"]  # (the launch's alignment: the tile's loads vectorized)
    before, wait, after = ptx.partition("griddepcontrol.wait")
    assert wait and "griddepcontrol.launch_dependents" in before
    loads = re.findall(r"\bld\.global[.\w]*", before)
    assert sum(".cg" in op for op in loads) >= 2, loads  # the expert id and its routing weight
    # the first [64, 128] bf16 tile, 16 bytes a load: 64 * 128 * 2 / 16 / 128 threads
    assert sum(".v4" in op for op in loads) == 8, loads
    assert "cp.async" not in before and "cp.async" in after
