"""The integer weight-only kernels (tests/gpu/test_wna16_gpu.py's checks) on the CPU through
Triton's interpreter, at small shapes, against their torch references: the GEMV (split-K, ragged
K) and the tensor-core GEMMs, "dot" and "dotj" (one scale row per tile, and tiles spanning several groups) over 4 and
8 bits, group and per-channel scales, symmetric and asymmetric zeros, bias; the dequantization
kernel. float32 and float16 activations (bf16 through `tl.dot` does not run in the interpreter,
see test_kernels_interpret.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from test_kernels_interpret import run_under_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

_CASES = {
    "gemv_g32_sym": ("check_wna16_gemm", [1, 48, 256, 4, 32, True], {"config": ["gemv", 1, 16, 128, 4, 1, 1]}),
    # PAGEDLLM_WNA16_PREFETCH=1: the next tile's words loaded first (ragged K range, split-K)
    "gemvp_prefetch_g32_asym_split": ("check_wna16_gemm", [2, 40, 320, 4, 32, False],
                                      {"config": ["gemvp", 1, 16, 128, 4, 1, 2], "prefetch": True, "bias": True}),
    # the register prefetch's addresses moved a tile an iteration: groups twice the tile (one scale row a
    # tile, a new one every other tile) and the tile's width, groups nesting neither way (48 against
    # 64-input tiles: a scale row per input)
    "gemvp_prefetch_g128_tile64_split": ("check_wna16_gemm", [1, 48, 1024, 4, 128, False],
                                         {"config": ["gemvp", 1, 16, 64, 4, 2, 2], "prefetch": True}),
    "gemvp_prefetch_g64_tile64_ragged": ("check_wna16_gemm", [2, 32, 448, 4, 64, True],
                                         {"config": ["gemvp", 1, 16, 64, 4, 2, 2], "prefetch": True}),
    # gemvp_config's tile for projections of at most 4,096 outputs (1,024 inputs, split 4) where K is
    # no multiple of it (Qwen2.5-7B's o, 3,584 inputs: the last split's one tile half masked)
    "gemvp_prefetch_g128_tile1024_split4_ragged": ("check_wna16_gemm", [1, 32, 3584, 4, 128, False],
                                                   {"config": ["gemvp", 1, 32, 1024, 8, 2, 4], "prefetch": True}),
    # the down projection's one-wave split of 3 (Llama-3.1-8B: 14 tiles as 5, 5, 4): 5 tiles as 2, 2, 1
    "gemvp_prefetch_g128_tile1024_split3": ("check_wna16_gemm", [1, 32, 5120, 4, 128, True],
                                            {"config": ["gemvp", 1, 32, 1024, 8, 2, 3], "prefetch": True}),
    # gate/up's 4-warp tile of 512 inputs (4 scale groups a tile, one split)
    "gemvp_prefetch_g128_tile512_w4": ("check_wna16_gemm", [1, 64, 2048, 4, 128, True],
                                       {"config": ["gemvp", 1, 32, 512, 4, 2, 1], "prefetch": True}),
    "gemvp_prefetch_g48_unnested": ("check_wna16_gemm", [2, 32, 384, 4, 48, False],
                                    {"config": ["gemvp", 1, 16, 64, 4, 2, 1], "prefetch": True}),
    # a config's 3 stages: Triton's software pipeline of the loop's loads (ragged K range, split-K)
    "gemvp_stages3_g32_asym_split": ("check_wna16_gemm", [2, 40, 320, 4, 32, False],
                                     {"config": ["gemvp", 1, 16, 128, 4, 3, 2], "bias": True}),
    "gemv_g64_asym_split_bias": ("check_wna16_gemm", [2, 40, 256, 4, 64, False],
                                 {"bias": True, "config": ["gemv", 1, 16, 64, 4, 1, 2]}),
    "gemv_channel_asym": ("check_wna16_gemm", [1, 32, 128, 4, None, False], {"config": ["gemv", 1, 32, 256, 4, 1, 1]}),
    "gemv_int8_ragged_k": ("check_wna16_gemm", [1, 32, 96, 8, 32, True], {"config": ["gemv", 1, 16, 64, 4, 1, 1]}),
    "gemv_int8_channel_split": ("check_wna16_gemm", [3, 24, 96, 8, None, False], {"config": ["gemv", 1, 16, 64, 4, 1, 2]}),
    "dot_g32_asym": ("check_wna16_gemm", [5, 48, 256, 4, 32, False], {"config": ["dot", 16, 16, 32, 4, 1, 1]}),
    "dot_tile_spans_groups_bias": ("check_wna16_gemm", [17, 40, 192, 4, 64, True],
                                   {"bias": True, "config": ["dot", 16, 32, 128, 4, 1, 1]}),
    "dot_channel_sym": ("check_wna16_gemm", [9, 32, 128, 4, None, True], {"config": ["dot", 16, 32, 32, 4, 1, 1]}),
    "dot_int8_asym": ("check_wna16_gemm", [9, 32, 96, 8, 32, False], {"config": ["dot", 16, 16, 32, 4, 1, 1]}),
    "dotj_g64_sym_scale_after": ("check_wna16_gemm", [9, 40, 256, 4, 64, True],
                                 {"config": ["dotj", 16, 32, 64, 4, 1, 1]}),
    "dotj_tile_spans_groups_asym_bias": ("check_wna16_gemm", [17, 40, 256, 4, 32, False],
                                         {"bias": True, "config": ["dotj", 16, 32, 128, 4, 1, 1]}),
    "dotj_channel_asym": ("check_wna16_gemm", [5, 32, 128, 4, None, False],
                          {"config": ["dotj", 16, 32, 64, 4, 1, 1]}),
    "dotj_int8_g64_asym": ("check_wna16_gemm", [9, 32, 128, 8, 64, False], {"config": ["dotj", 16, 16, 32, 4, 1, 1]}),
    "default_configs": ("check_wna16_gemm", [6, 40, 256, 4, 128, False], {}),
    # the packed 16-bit GEMV (its Triton-op path here; the GPU runs its PTX): 16-bit activations only
    "gemvp_g32_sym": ("check_wna16_gemm", [1, 48, 256, 4, 32, True], {"config": ["gemvp", 1, 16, 128, 4, 1, 1]}),
    "gemvp_g64_asym_split_bias": ("check_wna16_gemm", [2, 40, 256, 4, 64, False],
                                  {"bias": True, "config": ["gemvp", 1, 16, 64, 4, 1, 2]}),
    "gemvp_channel_asym_ragged": ("check_wna16_gemm", [1, 32, 192, 4, None, False],
                                  {"config": ["gemvp", 1, 32, 128, 4, 1, 1]}),
    # split-K summed by the last split of each (row, column block), twice in a row; and by atomics
    "gemv_split_last_twice": ("check_wna16_gemm", [3, 40, 512, 4, 64, True],
                              {"bias": True, "config": ["gemv", 1, 16, 64, 4, 1, 3], "reduce_last": True,
                               "calls": 2}),
    "gemv_split_atomics": ("check_wna16_gemm", [2, 40, 512, 4, 64, False],
                           {"config": ["gemv", 1, 16, 64, 4, 1, 3], "reduce_last": False}),
    # the steps-permuted layout (PAGEDLLM_WNA16_KPERM): slot k meets input kperm_input(k)
    "gemvp_kperm_g128_asym_split": ("check_wna16_gemm", [2, 40, 512, 4, 128, False],
                                    {"bias": True, "config": ["gemvp", 1, 16, 128, 4, 1, 2], "kperm": True}),
    "gemv_kperm_channel_split": ("check_wna16_gemm", [1, 32, 384, 4, None, False],
                                 {"config": ["gemv", 1, 16, 128, 4, 1, 2], "kperm": True}),
    "dot_kperm_g128_half_steps": ("check_wna16_gemm", [9, 40, 256, 4, 128, True],
                                  {"config": ["dot", 16, 32, 64, 4, 1, 1], "kperm": True}),
    "dotj_kperm_g128_asym_bias": ("check_wna16_gemm", [9, 40, 256, 4, 128, False],
                                  {"bias": True, "config": ["dotj", 16, 32, 128, 4, 1, 1], "kperm": True}),
    "dequant_kperm_channel_asym": ("check_wna16_dequant", [24, 256, 4, None, False], {"kperm": True}),
    "dequant_g32_asym": ("check_wna16_dequant", [40, 256, 4, 32, False], {}),
    "dequant_int8_channel": ("check_wna16_dequant", [24, 96, 8, None, True], {}),
}
_DTYPES = ["float32", "float16"]


def _keys():
    for name in _CASES:
        for dtype in ("float16", "bfloat16") if name.startswith("gemvp") else _DTYPES:
            yield f"{name}:{dtype}"


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_wna16_gpu.py", {key: _CASES[key.split(":")[0]] for key in _keys()})


@pytest.mark.parametrize("key", list(_keys()))
def test_wna16_kernel_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


@pytest.mark.parametrize("tiles", [(64, 128, 128, 8, 3), (128, 128, 64, 8, 4)])
def test_dotj_compiles_for_sm90(tiles):
    """The "dotj" GEMM compiles for the H200 at the bench's large-batch tiles: on the tensor cores
    (wgmma), its weight words pipelined (cp.async), nothing spilled, and its shared memory under
    60% of the "dot" kernel's (which stages an int32 word for every row of its weight tile; 46%
    and 52% at these tiles with Triton 3.9)."""
    from pagedllm.kernels import wna16_triton as w
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wk": "i32",
           "stride_sg": "i32", "stride_om": "i32"}
    bm, bn, bk, warps, stages = tiles
    shared = {}
    for join in (False, True):
        constexprs = {"BITS": 4, "GROUP_K": 128, "HAS_ZERO": False, "HAS_BIAS": False, "EVEN_K": True,
                      "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "DOT_PRECISION": "tf32", "JOIN": join}
        compiled = compile_sm90(w._wna16_gemm_kernel, sig, constexprs, warps, stages,
                                aligned=("N", "K", "stride_xm", "stride_wk", "stride_sg", "stride_om"))
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx
        r = resources(compiled)
        if r is None:
            pytest.skip("Triton's cuobjdump is not there")
        assert r["stack"] == 0, r
        shared[join] = r["shared"]
    assert shared[True] < 0.6 * shared[False], shared


def test_gemvp_needs_rows_aligned_as_int32_pairs():
    """gemvp reads the activations' rows as int32 pairs: a row starting mid-word (a view at an odd
    element) is a ValueError for an explicit gemvp config, and the default dispatch keeps gemv
    for it (PAGEDLLM_WNA16_GEMV=packed)."""
    import torch

    from pagedllm.kernels import wna16_triton
    from pagedllm.kernels.wna16 import quantize_wna16_torch

    x = torch.randn(1, 129, dtype=torch.float16)[:, 1:]  # 128 values from an odd element
    qw, s, _ = quantize_wna16_torch(torch.randn(16, 128) * 0.05, 4, 32, True, torch.float16)
    assert not wna16_triton._rows_as_int32_pairs(x) and wna16_triton._rows_as_int32_pairs(x.clone())
    with pytest.raises(ValueError, match="int32 pairs"):
        wna16_triton.wna16_gemm_triton(x, qw, s, None, 4, config=("gemvp", 1, 16, 128, 4, 1, 1))


@pytest.mark.parametrize("kind", ["gemv", "gemvp", "gemvp_prefetch", "gemvp_prefetch_kperm"])
def test_gemv_last_split_reduces_for_sm90(kind):
    """The GEMVs' split-K summed by the last split compiles for the H200 with the counting
    protocol in its PTX (the partials' stores, a barrier, the acq_rel gpu-scope count, the
    partials read back from the L2), spilling nothing; gemvp too with PAGEDLLM_WNA16_PREFETCH's
    loop (the next tile's words loaded first), and on the steps-permuted layout."""
    from test_small_m_interpret import check_last_program_ptx

    from pagedllm.kernels import wna16_triton as w
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32",
           "KW_PER_SPLIT": "i32", "stride_xm": "i32", "stride_wk": "i32", "stride_sg": "i32", "stride_om": "i32"}
    const = dict(GROUP_K=128, HAS_ZERO=False, HAS_BIAS=True, SPLIT_K=4, EVEN=True, BLOCK_N=32, BLOCK_KW=64, LAST=True,
                 **({"BITS": 4} if kind == "gemv" else {}), PREFETCH="prefetch" in kind, KPERM="kperm" in kind)
    kernel = w._wna16_gemv_kernel if kind == "gemv" else w._wna16_gemv_packed_kernel
    compiled = compile_sm90(kernel, sig, const, 4, 2, aligned=("N", "KW", "KW_PER_SPLIT", "stride_xm", "stride_wk",
                                                              "stride_sg", "stride_om"))
    check_last_program_ptx(compiled.asm["ptx"])
    r = resources(compiled)
    assert r is None or r["stack"] == 0, r


@pytest.mark.parametrize("switch, values", [
    ("gemv_prefetch", ((None, None), ("0", 0), ("1", 1), ("3", 3), ("4", 4), ("2", "error"))),
    ("gemv_pdl", ((None, True), ("0", False), ("1", True), ("yes", "error"))),
])  # fmt: skip
def test_gemv_switches(monkeypatch, switch, values):
    """PAGEDLLM_WNA16_PREFETCH: unset None (the mode per shape), 0, 1 (registers), or 3 / 4 pipeline
    stages; PAGEDLLM_WNA16_PDL: on by default, 0 off; anything else a ValueError naming the variable."""
    from pagedllm.kernels import wna16_triton

    env = {"gemv_prefetch": "PAGEDLLM_WNA16_PREFETCH", "gemv_pdl": "PAGEDLLM_WNA16_PDL"}[switch]
    read = getattr(wna16_triton, switch)
    for value, want in values:
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        read.cache_clear()
        if want == "error":
            with pytest.raises(ValueError, match=f"{env}='{value}'"):
                read()
        else:
            assert read() == want and type(read()) is type(want)
    read.cache_clear()


def test_gemvp_config_splits_in_one_wave(monkeypatch):
    """A projection of at most 4,096 outputs splits its inputs 4 ways where its programs then start in
    one wave (GEMVP_PROGRAMS_AN_SM an SM), else 2: Llama-3.1-8B's o (4,096 x 4,096) on 132 SMs 256
    programs, a 2,048-output one 256 at 4 ways; on a device of 200 SMs o takes 4 ways too. One of
    8,192 inputs or more splits as many ways as start in one wave, up to 4."""
    from pagedllm.kernels import wna16_triton as w

    monkeypatch.setattr(w, "num_sms", lambda: 132)
    assert w.gemvp_config(4096, 4096) == ("gemvp", 1, 32, 1024, 8, 2, 2)
    assert w.gemvp_config(2048, 2048) == ("gemvp", 1, 32, 1024, 8, 2, 4)
    assert w.engine_config(1, 4096, 4096, 128, 4, torch.bfloat16)[-1] == 2
    # 14,336 inputs (Llama-3.1-8B's down): as many ways as fit one wave, 3 (384 programs of 396); at
    # 8,192 outputs not 2 ways (512 programs): 512-input tiles split 4
    assert w.gemvp_config(4096, 14336) == ("gemvp", 1, 32, 1024, 8, 2, 3)
    assert w.gemvp_config(2048, 14336) == ("gemvp", 1, 32, 1024, 8, 2, 4)
    assert w.gemvp_config(8192, 28672) == ("gemvp", 1, 32, 512, 8, 2, 4)
    # a gate/up wider than 8,192: 4-warp 512-input tiles where its 32-column ones fit one wave of 8 an SM
    assert w.gemvp_config(28672, 4096) == ("gemvp", 1, 32, 512, 4, 2, 1)  # 896 programs of 1,056
    assert w.gemvp_config(37888, 3584) == ("gemvp", 1, 32, 1024, 8, 2, 1)  # Qwen2.5-7B's 1,184: 8 warps
    monkeypatch.setattr(w, "num_sms", lambda: 200)
    assert w.gemvp_config(4096, 4096) == ("gemvp", 1, 32, 1024, 8, 2, 4)
    assert w.gemvp_config(4096, 14336) == ("gemvp", 1, 32, 1024, 8, 2, 4)


def test_gemvp_config_override(monkeypatch):
    """PAGEDLLM_GEMVP_CONFIG replaces gemvp_config's tiles for the shapes it names (others keep
    theirs, and engine_config takes them for one bf16 row); a malformed entry is a ValueError naming
    the variable."""
    from pagedllm.kernels import wna16_triton as w

    default_qkv, default_o = w.gemvp_config(6144, 4096), w.gemvp_config(4096, 4096)
    try:
        monkeypatch.setenv("PAGEDLLM_GEMVP_CONFIG", "6144,4096:64,1024,8,2,3; 28672,4096:32,512,4,2,4;")
        w.gemvp_overrides.cache_clear()
        assert w.gemvp_config(6144, 4096) == ("gemvp", 1, 64, 1024, 8, 2, 3) != default_qkv
        assert w.gemvp_config(28672, 4096) == ("gemvp", 1, 32, 512, 4, 2, 4)
        assert w.gemvp_config(4096, 4096) == default_o
        assert w.engine_config(1, 6144, 4096, 128, 4, torch.bfloat16) == ("gemvp", 1, 64, 1024, 8, 2, 3)
        for bad in ("6144,4096:64,1024,8,2", "6144:64,1024,8,2,2", "6144,4096:48,1024,8,2,2",
                    "6144,4096:64,1000,8,2,2", "6144,4096:64,1024,8,5,2", "6144,4096:64,1024,8,2,0", "a,b:c"):
            monkeypatch.setenv("PAGEDLLM_GEMVP_CONFIG", bad)
            w.gemvp_overrides.cache_clear()
            with pytest.raises(ValueError, match="PAGEDLLM_GEMVP_CONFIG"):
                w.gemvp_config(6144, 4096)
    finally:
        w.gemvp_overrides.cache_clear()


_GEMV_ALIGNED = ("N", "KW", "KW_PER_SPLIT", "stride_xm", "stride_wk", "stride_sg", "stride_om")


def _compile_gemv(kind: str, x: str, asm: bool, capability: int):
    """gemvp (K-packed) or gemvn (N-major) at Llama-3.1-8B's q/k/v tile, compiled for `capability`."""
    from pagedllm.kernels import wna16_gemv_triton as gp
    from pagedllm.kernels import wna16_gemvn_triton as gn
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    stride_w, stride_s = ("stride_wk", "stride_sg") if kind == "gemvp" else ("stride_wn", "stride_sn")
    sig = {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": f"*{x}", "z_ptr": f"*{x}", "b_ptr": f"*{x}", "out_ptr": f"*{x}",
           "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32", "KW_PER_SPLIT": "i32",
           "stride_xm": "i32", stride_w: "i32", stride_s: "i32", "stride_om": "i32"}
    const = dict(GROUP_K=128, HAS_ZERO=False, HAS_BIAS=False, SPLIT_K=1, EVEN=True, BLOCK_N=64, BLOCK_KW=128,
                 ASM=asm, PREFETCH=True)
    if kind == "gemvp":
        const.update(LAST=False, KPERM=True)
    aligned = tuple(a.replace("stride_wk", stride_w).replace("stride_sg", stride_s) for a in _GEMV_ALIGNED)
    kernel = gp._wna16_gemv_packed_kernel if kind == "gemvp" else gn._wna16_gemvn_kernel
    return compile_sm90(kernel, sig, const, 8, 2, aligned=aligned, capability=capability)


@pytest.mark.parametrize("kind", ["gemvp", "gemvn"])
def test_bf16_gemvs_compile_for_sm80_without_inline_ptx(kind):
    """An A100 (sm_80) has no sub / mul .bf16x2, so the 4-bit GEMVs' bfloat16 PTX does not compile for
    it (why `_triton.inline_ptx` turns ASM off there for bfloat16); their plain-op path does, and
    float16's PTX (f16x2) does."""
    with pytest.raises(Exception, match="bf16x2"):
        _compile_gemv(kind, "bf16", True, 80)
    assert "bf16x2" not in _compile_gemv(kind, "bf16", False, 80).asm["ptx"]
    assert "lop3.b32" in _compile_gemv(kind, "fp16", True, 80).asm["ptx"]


def test_inline_ptx_rule(monkeypatch):
    """`_triton.inline_ptx`: the 4-bit kernels' PTX on CUDA outside the interpreter, bfloat16 only from
    sm_90 on (float16 on any); a CPU device or TRITON_INTERPRET=1 never."""
    from pagedllm.kernels import _triton

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for major, bf16 in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(_triton, "capability_major", lambda index, major=major: major)
        assert _triton.inline_ptx(cuda, torch.bfloat16) is bf16
        assert _triton.inline_ptx(cuda, torch.float16) is True
        assert _triton.inline_ptx(torch.device("cpu"), torch.float16) is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _triton.inline_ptx(cuda, torch.float16) is False
