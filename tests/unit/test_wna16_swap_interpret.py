"""The 4-bit swap-AB tensor-core kernel (kernels/wna16_swap_triton.py) on the CPU: the checks of
tests/gpu/test_wna16_nk_gpu.py through Triton's interpreter at small shapes against the torch
reference (1, 3 and 16 rows, 40 rows in three launches; groups of 32 / 128 and per channel,
symmetric and asymmetric; BLOCK_K above and below the group; N and K not multiples of the tiles;
split-K; bias; float32 activations through fp16 operands), which runs the plain Triton
dequantization (the interpreter cannot run PTX); the N-major prefill dequantization; the
layout's round trip; the kernel compiled for the H200 with its PTX dequantization (the lop3 /
half2 instructions, tensor-core MMA, no spills); and the switch."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_kernels_interpret import run_under_interpreter

from pagedllm.kernels.wna16 import (
    dequantize_int4_nk_torch,
    dequantize_wna16_torch,
    pack_int4_nk,
    quantize_wna16_torch,
    swap_enabled,
    to_int4_nk,
    unpack_int4_nk,
    wna16_int4_nk_linear,
    wna16_linear_torch,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (m, n, k, group_k, symmetric) + kwargs; config: SwapConfig fields (block_n, block_k, split_k, warps, stages)
_CASES = {
    "m1_g32_sym_tile_spans_groups": ("check_wna16_swap", [1, 40, 256, 32, True], {"config": [32, 64, 1, 4, 1]}),
    "m3_channel_asym_split_bias": (
        "check_wna16_swap",
        [3, 72, 200, None, False],
        {"bias": True, "config": [32, 64, 2, 4, 1]},
    ),
    "m16_g128_asym_split3": ("check_wna16_swap", [16, 40, 384, 128, False], {"config": [16, 64, 3, 4, 1]}),
    "m5_g64_sym_split_ragged": ("check_wna16_swap", [5, 40, 320, 64, True], {"config": [32, 128, 2, 4, 1]}),
    "m1_g32_asym_bf16_scales": (
        "check_wna16_swap",
        [1, 24, 128, 32, False],
        {"config": [16, 64, 1, 4, 1], "scale_dtype": "bfloat16"},
    ),
    "m40_three_launches_bias": (
        "check_wna16_swap",
        [40, 24, 128, 32, False],
        {"bias": True, "config": [16, 32, 2, 4, 1]},
    ),
    "default_config": ("check_wna16_swap", [2, 40, 256, 128, True], {}),
    # the N-major one-row GEMV: one split and split-K (the last split adds), groups spanning words,
    # per channel, asymmetric, bias, a ragged N and K tile; two rows (a program each)
    "gemvn_g32_asym_bias": ("check_wna16_gemvn", [1, 20, 256, 32, False], {"bias": True, "config": [8, 16, 1, 4]}),
    "gemvn_split3_channel": ("check_wna16_gemvn", [2, 24, 384, None, True], {"config": [8, 16, 3, 4]}),
    "gemvn_g128_ragged_default": ("check_wna16_gemvn", [1, 40, 640, 128, True], {}),
    "gemvn_one_group_tiles_asym_split": ("check_wna16_gemvn", [1, 40, 512, 32, False],
                                         {"bias": True, "config": [16, 4, 2, 4]}),
    "gemvn_prefetch_split_ragged": ("check_wna16_gemvn", [1, 40, 640, 64, False],
                                    {"config": [16, 8, 3, 4], "prefetch": True}),
    # the GEMM: 64- and 128-row activation tiles over M (ragged), split-K, groups, zeros, bias
    "gemm_m70_bm64_g64_asym_bias": ("check_wna16_swap", [70, 40, 256, 64, False],
                                    {"bias": True, "config": [32, 64, 1, 4, 1, "kernel", 64]}),
    "gemm_m150_bm128_split2_sym": ("check_wna16_swap", [150, 24, 256, 128, True],
                                   {"config": [16, 64, 2, 4, 1, "kernel", 128]}),
    "gemm_m100_default": ("check_wna16_swap", [100, 40, 512, 128, True], {}),
    # the pairs kernel (SwapConfig.pairs): a group a K step and a group per word, per channel through
    # the reduce, zeros, bias, a ragged split, 64- and 128-row tiles
    "pairs_m70_bm64_g64_asym_bias": ("check_wna16_swap", [70, 40, 256, 64, False],
                                     {"bias": True, "config": [32, 64, 1, 4, 1, "kernel", 64, True]}),
    "pairs_m150_bm128_split2_ragged": ("check_wna16_swap", [150, 24, 384, 128, True],
                                       {"config": [16, 128, 2, 4, 1, "kernel", 128, True]}),
    "pairs_m40_g32_per_word_asym": ("check_wna16_swap", [40, 24, 256, 32, False],
                                    {"config": [16, 64, 1, 4, 1, "kernel", 64, True]}),
    # 384 inputs in two splits of 256 (steps of 128), NaN past the last group: no step past K
    "split_past_the_end_plain": ("check_wna16_swap", [24, 40, 384, 128, False],
                                 {"config": [32, 128, 2, 4, 1, "kernel", 32], "nan_past_end": True}),
    "split_past_the_end_pairs": ("check_wna16_swap", [24, 40, 384, 128, False],
                                 {"config": [32, 128, 2, 4, 1, "kernel", 32, True], "nan_past_end": True}),
    "pairs_m33_channel_split3_bias": ("check_wna16_swap", [33, 40, 512, None, False],
                                      {"bias": True, "config": [32, 128, 3, 4, 1, "kernel", 64, True]}),
    "dequant_g32_asym": ("check_int4_nk_dequant", [40, 512, 32, False], {}),
    "dequant_channel_sym": ("check_int4_nk_dequant", [24, 264, None, True], {}),
}
_DTYPES = {"check_wna16_swap": ["bfloat16", "float16", "float32"], "check_int4_nk_dequant": ["float16", "float32"],
           "check_wna16_gemvn": ["bfloat16", "float16"]}
_KEYS = [f"{name}:{dt}" for name, case in _CASES.items() for dt in _DTYPES[case[0]]]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_wna16_nk_gpu.py", {key: _CASES[key.split(":")[0]] for key in _KEYS})


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("key", _KEYS)
def test_wna16_swap_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


@pytest.mark.parametrize("group_k,symmetric", [(32, False), (128, True), (None, False)])
def test_layout_round_trip(group_k, symmetric):
    """K-packed -> N-major keeps every integer, scale and zero: the dequantized weights are equal,
    and the N-major linear on the CPU is the K-packed reference's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (256, 24), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_int4_nk(pack_int4_nk(q)), q)
    w = torch.randn(24, 256, generator=g) * 0.05
    qw, s, z = quantize_wna16_torch(w, 4, group_k, symmetric, torch.bfloat16)
    qn, sn, zn = to_int4_nk(qw, s, z)
    assert qn.shape == (24, 32) and sn.shape == (24, s.shape[0]) and sn.stride(1) == 1
    assert torch.equal(
        dequantize_int4_nk_torch(qn, sn, zn, torch.float32), dequantize_wna16_torch(qw, s, z, 4, torch.float32)
    )
    x = torch.randn(3, 256, generator=g)
    torch.testing.assert_close(wna16_int4_nk_linear(x, qn, sn, zn), wna16_linear_torch(x, qw, s, z, 4))


def test_word_holds_pairs_for_the_magic_number():
    """Inputs 2i and 2i + 1 of a word sit at nibbles i and i + 4, so one mask of 0x000F000F (after a
    shift by 4 i) puts them in the low and high halves: 1024 + q as fp16 under 0x6400."""
    q = torch.arange(8, dtype=torch.int32).view(8, 1) + 3  # inputs 0..7 of one output: 3..10
    word = int(pack_int4_nk(q)[0, 0]) & 0xFFFFFFFF
    for i in range(4):
        pair = ((word >> (4 * i)) & 0x000F000F) | 0x64006400
        halves = torch.tensor([pair & 0xFFFF, pair >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
        assert halves.tolist() == [1024.0 + 3 + 2 * i, 1024.0 + 4 + 2 * i]


def _signature(x: str, split_k: int) -> dict:
    return {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16",
            "out_ptr": "*fp32" if split_k > 1 else f"*{x}", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32",
            "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(
    "x, group_k, has_zero, block_n, block_k, split_k, warps, block_m",
    [("bf16", 128, False, 64, 128, 1, 4, 16), ("bf16", 128, True, 64, 128, 4, 4, 16),
     ("bf16", 32, True, 64, 128, 1, 4, 16), ("fp16", 0, True, 128, 128, 2, 8, 16),
     ("fp16", 128, False, 32, 128, 1, 4, 16), ("bf16", 64, False, 64, 256, 2, 4, 16),
     ("bf16", 128, False, 128, 64, 1, 8, 128), ("bf16", 128, True, 128, 64, 2, 4, 64),
     ("fp16", 32, False, 128, 64, 1, 8, 128)],
)  # fmt: skip
def test_swap_int4_kernel_compiles_for_sm90(x, group_k, has_zero, block_n, block_k, split_k, warps, block_m):
    """Compiled for the H200 with the PTX dequantization: wgmma from 64-row weight tiles (mma.sync
    below) on operands of x's 16-bit type, the pairs made by lop3 with the magic number and
    sub / fma on 16-bit pairs (mul too where the scale goes into the tile: a tile spanning
    groups, or the GEMM's), pipelined
    asynchronous copies, no spills, the registers reported. The GEMM's tiles (64 or 128 rows of x
    a program, the large-batch default_config): wgmma takes the dequantized weight from registers
    (its A operand four registers, x's tile a shared-memory descriptor). (The PTX does not show
    that Triton gets those registers through shared memory, converting the joined tile's layout:
    the SASS does, test_swap_int4_pairs_kernel_builds_the_operand_in_registers.)"""
    from pagedllm.kernels import wna16_swap_triton as k
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    constexprs = {"GROUP_K": group_k, "HAS_ZERO": has_zero, "HAS_BIAS": True, "EVEN_K": True, "SPLIT_K": split_k,
                  "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "W_BF16": x == "bf16", "ASM": True,
                  "FP16_MAX_": 65504.0}  # fmt: skip
    compiled = compile_sm90(k._swap_int4_kernel, _signature(x, split_k), constexprs, num_warps=warps, num_stages=3,
                            aligned=("N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om"))  # fmt: skip
    ptx = compiled.asm["ptx"]
    kind = "wgmma.mma_async" if block_n >= 64 else "mma.sync"
    ptx_type = {"bf16": "bf16", "fp16": "f16"}[x]
    assert kind in ptx and f".{ptx_type}.{ptx_type}" in ptx
    magic = "0x43004300" if x == "bf16" else "0x64006400"
    assert ptx.count(magic) >= 4 and "lop3.b32" in ptx
    assert ("sub.rn.bf16x2" if x == "bf16" else "fma.rn.f16x2") in ptx
    # the scale goes into the tile where a tile spans groups, and in the GEMM's tiles
    assert (("mul.rn.bf16x2" if x == "bf16" else "mul.f16x2") in ptx) == (0 < group_k and (group_k < block_k
                                                                                          or block_m > 16))
    assert "cp.async" in ptx
    if block_m > 16:
        import re

        wgmma = re.findall(r"wgmma\.mma_async[^;]*", ptx)
        assert wgmma and all(re.search(r"\}, \{%r\d+,\s*%r\d+,\s*%r\d+,\s*%r\d+\}, %rd\d+", w) for w in wgmma), \
            "the weight operand not in registers"
    r = resources(compiled)
    if r is not None:
        assert r["stack"] == 0 and 0 < r["regs"] <= 255, r
        print(f"{x} g{group_k} {block_n}x{block_k} split {split_k}: {r['regs']} registers, {r['shared']} B shared")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("x, group_k, has_zero, block_m, block_k, warps",
                         [("bf16", 128, False, 128, 128, 8), ("bf16", 128, True, 128, 64, 8),
                          ("fp16", 128, False, 64, 128, 4), ("bf16", 0, True, 128, 128, 8)])  # fmt: skip
def test_swap_int4_pairs_kernel_builds_the_operand_in_registers(x, group_k, has_zero, block_m, block_k, warps):
    """The pairs kernel (SwapConfig.pairs) compiled for the H200: wgmma reads the weight from
    registers, and its main loop has no shared-memory round trip for it (no ldmatrix, no 128-bit
    shared stores) where the plain kernel's has both (Triton converts its joined tile's layout
    through shared memory); the pair made by one shift and one lop3 with the magic number."""
    from pagedllm.kernels import wna16_pairs_triton as p
    from pagedllm.kernels import wna16_swap_triton as k
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    constexprs = {"GROUP_K": group_k, "HAS_ZERO": has_zero, "HAS_BIAS": True, "EVEN_K": True, "SPLIT_K": 1,
                  "BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": block_k, "W_BF16": x == "bf16", "ASM": True,
                  "FP16_MAX_": 65504.0}  # fmt: skip
    aligned = ("N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om")
    plain, pairs = (pairs_main_loop(compile_sm90(kernel, _signature(x, 1), constexprs, num_warps=warps, num_stages=3,
                                                 aligned=aligned), x, check_pairs=kernel is not k._swap_int4_kernel)
                    for kernel in (k._swap_int4_kernel, p._swap_int4_pairs_kernel))  # fmt: skip
    assert plain["LDSM.16.M88."] > 0 and plain["STS.128"] > 0, plain  # the check sees the round trip where it is
    assert pairs["HGMMA"] > 0 and pairs["LDSM.16.M88."] == 0 and pairs["STS.128"] == 0, pairs


def pairs_main_loop(compiled, x: str, check_pairs: bool = True) -> dict:
    """A compiled 4-bit GEMM's main-loop counts of what moves a tile through shared memory
    (STS.128, ldmatrix of a 16-bit tile LDSM.16.M88, a transposing one .MT88) and its HGMMAs,
    from its sm_90 SASS (the test skips without Triton's nvdisasm). check_pairs: first that its
    PTX makes the pairs with lop3 and the magic number and feeds wgmma's weight operand from
    registers, nothing spilled."""
    import re

    from pagedllm.kernels.inspect_sm90 import main_loop, resources, sass

    if check_pairs:
        ptx = compiled.asm["ptx"]
        wgmma = re.findall(r"wgmma\.mma_async[^;]*", ptx)
        assert wgmma and all(re.search(r"\}, \{%r\d+,\s*%r\d+,\s*%r\d+,\s*%r\d+\}, %rd\d+", w) for w in wgmma)
        assert ptx.count("0x43004300" if x == "bf16" else "0x64006400") >= 4 and "lop3.b32" in ptx
        r = resources(compiled)
        if r is not None:
            assert r["stack"] == 0 and r["regs"] <= 255, r
    listing = sass(compiled)
    if listing is None:
        pytest.skip("Triton's nvdisasm is not there")
    loop = main_loop(listing)
    return {kind: sum(n for op, n in loop.items() if op.startswith(kind))
            for kind in ("HGMMA", "LDSM.16.M88.", "LDSM.16.MT88", "STS.128")}


def test_large_gemm_switch(monkeypatch):
    from pagedllm.kernels import wna16

    for value, want in (("", None), ("dense", "dense"), ("swap", "swap"), (" Pairs ", "pairs"), ("tensor", ValueError)):
        monkeypatch.setenv("PAGEDLLM_WNA16_GEMM", value)
        wna16.large_gemm.cache_clear()
        if want is ValueError:
            with pytest.raises(ValueError, match="PAGEDLLM_WNA16_GEMM='tensor'"):
                wna16.large_gemm()
        else:
            assert wna16.large_gemm() == want
    monkeypatch.delenv("PAGEDLLM_WNA16_GEMM")
    wna16.large_gemm.cache_clear()
    assert wna16.large_gemm() is None, "unset: each layout's default"
    assert wna16.LAYOUT_DEFAULT == {"k_packed": "pairs", "n_major": "swap"}
    wna16.large_gemm.cache_clear()


def test_switch(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_WNA16_SWAP", raising=False)
    assert not swap_enabled(), "off by default"
    for value, on in (("0", False), ("", False), ("1", True), ("on", True)):
        monkeypatch.setenv("PAGEDLLM_WNA16_SWAP", value)
        assert swap_enabled() == on
    monkeypatch.setenv("PAGEDLLM_WNA16_SWAP", "maybe")
    with pytest.raises(ValueError, match="PAGEDLLM_WNA16_SWAP"):
        swap_enabled()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("x, group_k, has_zero, prefetch", [("bf16", 128, False, False), ("fp16", 32, True, False),
                                                           ("bf16", 0, True, False), ("bf16", 128, False, True)])
def test_gemvn_kernel_compiles_for_sm90(x, group_k, has_zero, prefetch):
    """The N-major one-row GEMV at its default tiles compiles for the H200 with the packed 16-bit
    dequantization (lop3 with the magic number, products on 16-bit pairs), nothing spilled; also
    loading the next tile's words first (PAGEDLLM_WNA16_PREFETCH)."""
    from pagedllm.kernels import wna16_gemvn_triton as g
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    block_n, block_kw, _, warps = g.gemvn_config(4096, 4096, group_k)
    sig = {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": f"*{x}", "z_ptr": f"*{x}", "b_ptr": f"*{x}", "out_ptr": f"*{x}",
           "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32", "KW_PER_SPLIT": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}
    constexprs = {"GROUP_K": group_k, "HAS_ZERO": has_zero, "HAS_BIAS": False, "SPLIT_K": 2, "EVEN": True,
                  "BLOCK_N": block_n, "BLOCK_KW": block_kw, "ASM": True, "PREFETCH": prefetch}
    compiled = compile_sm90(g._wna16_gemvn_kernel, sig, constexprs, num_warps=warps, num_stages=2,
                            aligned=("N", "KW", "KW_PER_SPLIT", "stride_xm", "stride_wn", "stride_sn", "stride_om"))
    ptx = compiled.asm["ptx"]
    assert ptx.count("0x43004300" if x == "bf16" else "0x64006400") >= 2 and "lop3.b32" in ptx
    assert ("fma.rn.bf16x2" if x == "bf16" else "fma.rn.f16x2") in ptx
    r = resources(compiled)
    if r is not None:
        assert r["stack"] == 0, r
