"""The 16-bit small-row GEMM (kernels/small_m.py, the swap-AB kernel of swap_gemm_triton.py) on the
CPU: tests/gpu/test_small_m_gpu.py's check through Triton's interpreter at small shapes (1, 3, 5
and 16 rows; N not a multiple of BLOCK_N, K not of BLOCK_K; bias; split-K through the workspace;
float32 output as the MoE router wants), bfloat16 and float16; the kernel
compiled for the H200 (tensor-core MMA, no spills); and the switch and config rules."""

from __future__ import annotations

import importlib.util
import re

import pytest
from test_kernels_interpret import run_under_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None

# SwapConfig fields: (block_n, block_k, split_k, num_warps, num_stages[, reduce])
_CASES = {
    "one_row": ("check_small_m_linear", [1, 40, 64], {"config": [32, 32, 1, 4, 1]}),
    "rows3_bias_ragged_k": ("check_small_m_linear", [3, 72, 200], {"bias": True, "config": [32, 64, 1, 4, 1]}),
    "rows16_split_k_bias": ("check_small_m_linear", [16, 40, 200], {"bias": True, "config": [16, 32, 3, 4, 1]}),
    "rows5_split4_bias": ("check_small_m_linear", [5, 40, 192], {"bias": True, "config": [32, 32, 4, 4, 1]}),
    "float32_out_split_k": (
        "check_small_m_linear",
        [2, 24, 128],
        {"out_dtype": "float32", "config": [16, 32, 2, 4, 1]},
    ),
    "float32_out_split3_bias": (
        "check_small_m_linear",
        [3, 24, 96],
        {"out_dtype": "float32", "bias": True, "config": [16, 32, 3, 4, 1]},
    ),
    "default_config": ("check_small_m_linear", [4, 40, 256], {}),
    # split-K reduced by the last program of each N tile: the reduce kernel's bits, twice in a row
    # (the first call must leave the counters at zero), bias, ragged N and K, float32 output
    "last_reduce_bias_ragged": ("check_last_reduce", [3, 40, 200], {"bias": True, "config": [16, 32, 3, 4, 1]}),
    "last_reduce_float32_out": ("check_last_reduce", [2, 24, 128],
                                {"out_dtype": "float32", "config": [16, 32, 2, 4, 1]}),
    # the fused router: 1 and 5 tokens, 2 N tiles x 2 splits, a ragged expert count, ties, renormalized
    "router_topk": ("check_router_topk", [1, 24, 128, 4, False], {"config": [16, 32, 2, 4, 1]}),
    "router_topk_ties_renorm": ("check_router_topk", [5, 20, 96, 3, True],
                                {"config": [16, 32, 3, 4, 1], "ties": True}),
    "router_topk_one_split": ("check_router_topk", [2, 12, 64, 2, True], {"config": [16, 32, 1, 4, 1]}),
}
_DTYPES = ["bfloat16", "float16"]
_KEYS = [f"{name}:{dt}" for name in _CASES for dt in _DTYPES]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_small_m_gpu.py", {key: _CASES[key.split(":")[0]] for key in _KEYS})


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("key", _KEYS)
def test_small_m_linear_under_interpreter(interpreter_results, key):
    error = interpreter_results[key]
    assert error is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{error}"


SWAP_ALIGNED = ("N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_om")


def swap_signature(out: str = "*bf16", weight: str = "*bf16", scale: str = "*bf16") -> dict:
    """The swap-AB kernel's runtime arguments (16-bit activations), in its parameter order."""
    sig = {"x_ptr": "*bf16", "w_ptr": weight, "s_ptr": scale, "b_ptr": "*bf16", "out_ptr": out, "ws_ptr": "*fp32",
           "count_ptr": "*i32", "topk_weights_ptr": "*fp32", "topk_ids_ptr": "*i64"}
    sig.update(dict.fromkeys(("M", "N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_sn", "stride_om"), "i32"))
    return sig


def swap_constexprs(split_k: int, block_n: int, block_k: int, **over) -> dict:
    """Its constexprs in parameter order: a 16-bit weight with bias, split-K through the workspace
    and the reduce kernel unless `over` says otherwise."""
    from pagedllm.kernels import swap_gemm_triton as s

    c = {"SCALED": False, "GROUP_K": 0, "HAS_BIAS": True, "EVEN_K": True, "SPLIT_K": split_k,
         "WORKSPACE": split_k > 1, "LAST": False, "TOP_K": 0, "RENORMALIZE": False, "BLOCK_E": 1, "BLOCK_TOPK": 1,
         "BLOCK_M": s.SWAP_BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": block_k, "OPERANDS": "weight",
         "FP16_MAX_": s.FP16_MAX}
    c.update(over)
    return c


def check_last_program_ptx(ptx: str) -> None:
    """A "last program reduces" kernel's PTX: the partials' stores, a barrier, then the count's
    acq_rel atomic at gpu scope, and the partials read back from the L2 (.cg) after it."""
    import re

    atom = re.search(r"atom\.global\.gpu\.acq_rel\.add\.[us]32", ptx)
    assert atom is not None, "no acq_rel gpu-scope atomic"
    assert "bar.sync" in ptx[: atom.start()].rsplit("st.global", 1)[-1], "no barrier between stores and count"
    assert "ld.global.cg" in ptx[atom.end() :], "the partials not read from the L2"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(
    "mode, block_n, block_k, split_k, warps, stages",
    [("last", 64, 128, 4, 4, 3), ("last", 64, 128, 8, 4, 3), ("last", 64, 256, 4, 4, 3), ("router", 64, 128, 8, 4, 4),
     ("router", 128, 128, 8, 4, 4)],
)
def test_last_program_modes_compile_for_sm90(mode, block_n, block_k, split_k, warps, stages):
    """Split-K reduced by the last split (the table's split-K configs: Qwen3-30B-A3B o 64/128/4,
    Qwen3-0.6B o and down 64/128/8, Llama-3.1-8B o 64/128/4) and the fused router (the router's
    64/128/8 at 128 experts, top-8; and 128-wide tiles) compile for the H200: tensor cores,
    pipelined loads, the counting protocol in the PTX, nothing spilled."""
    from pagedllm.kernels import swap_gemm_triton as s
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    if mode == "last":
        constexprs = swap_constexprs(split_k, block_n, block_k, LAST=True)
        signature = swap_signature()
    else:
        constexprs = swap_constexprs(split_k, block_n, block_k, HAS_BIAS=False, WORKSPACE=True, TOP_K=8,
                                     RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8)
        signature = swap_signature("*fp32")
    compiled = compile_sm90(s._swap_kernel, signature, constexprs, num_warps=warps, num_stages=stages,
                            aligned=SWAP_ALIGNED)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    check_last_program_ptx(ptx)
    r = resources(compiled)
    if r is not None:
        assert r["stack"] == 0, r


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(
    "block_n, block_k, split_k, warps", [(64, 128, 4, 4), (128, 128, 1, 8), (32, 256, 8, 4)]
)
def test_swap_kernel_16bit_compiles_for_sm90(block_n, block_k, split_k, warps):
    """The kernel on bf16 weights compiles for the H200, its products run on tensor cores
    (wgmma for 64-row weight tiles and up, mma.sync below), its tile loads are asynchronous
    copies (pipelined), nothing spills, and the MMA takes the bf16 operands as they are."""
    from pagedllm.kernels import swap_gemm_triton as s
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    signature = swap_signature("*fp32" if split_k > 1 else "*bf16")
    constexprs = swap_constexprs(split_k, block_n, block_k)
    compiled = compile_sm90(s._swap_kernel, signature, constexprs, num_warps=warps, num_stages=3, aligned=SWAP_ALIGNED)
    ptx = compiled.asm["ptx"]
    if block_n >= 64:
        assert "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx
    else:
        assert "mma.sync" in ptx and ".bf16.bf16" in ptx
    assert "cp.async" in ptx
    assert not re.search(r"(^|\s)(red|atom)\.", ptx, re.M)  # the workspace and its reduce kernel: no atomics
    r = resources(compiled)
    if r is not None:
        assert r["stack"] == 0, r


def test_switch(monkeypatch):
    from pagedllm.kernels import small_m

    monkeypatch.delenv("PAGEDLLM_SMALL_M_GEMM", raising=False)
    assert small_m.enabled("linear") and small_m.enabled("router"), "on by default"
    for value, linear, router in (
        ("", True, True),
        ("0", False, False),
        ("1", True, True),
        ("all", True, True),
        ("linear", True, False),
        ("router", False, True),
        ("linear,router", True, True),
    ):
        monkeypatch.setenv("PAGEDLLM_SMALL_M_GEMM", value)
        assert (small_m.enabled("linear"), small_m.enabled("router")) == (linear, router), value
    monkeypatch.setenv("PAGEDLLM_SMALL_M_GEMM", "attention")
    with pytest.raises(ValueError, match="PAGEDLLM_SMALL_M_GEMM"):
        small_m.enabled("linear")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_configs(monkeypatch, request):
    """The heuristic splits K while the programs stay within _TARGET_PROGRAMS, each split keeping
    two K steps; it agrees with the measured table on most of its shapes; the table overrides it per
    shape and row count, None meaning cuBLAS (as do weights of _CUBLAS_MIN_ELEMENTS); pick()
    declines CPU tensors."""
    import dataclasses

    import torch

    from pagedllm.kernels import small_m
    from pagedllm.kernels.swap_gemm_triton import SWAP_BLOCK_M, SwapConfig

    assert small_m.MAX_ROWS == SWAP_BLOCK_M
    agree = 0
    for (n, k), entries in small_m.CONFIGS.items():
        cfg = small_m.heuristic_config(1, n, k)
        programs = -(-n // cfg.block_n) * cfg.split_k
        assert programs <= small_m._TARGET_PROGRAMS or cfg.split_k == 1, (n, k, cfg)
        assert k >= 2 * cfg.block_k * cfg.split_k, (n, k, cfg)
        measured = entries[-1][1]
        agree += measured is not None and (measured[0], measured[2]) == (cfg.block_n, cfg.split_k)
    assert agree >= 6, agree
    assert small_m.default_config(1, 28672, 4096) is None and small_m.default_config(1, 8192, 8192) is None
    monkeypatch.setitem(small_m.CONFIGS, (512, 1024), [(4, (32, 128, 2, 4, 3)), (16, None)])
    small_m.default_config.cache_clear()  # its answers were cached from the table before
    request.addfinalizer(small_m.default_config.cache_clear)  # and must not outlive the patch
    assert small_m.default_config(3, 512, 1024) == SwapConfig(32, 128, 2, 4, 3, reduce="last")
    assert small_m.default_config(8, 512, 1024) is None
    heuristic = small_m.heuristic_config(8, 512, 2048)
    assert small_m.default_config(8, 512, 2048) == dataclasses.replace(
        heuristic, reduce="last" if heuristic.split_k > 1 else "kernel")
    assert small_m.pick(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)) is None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_last_reduce_switch(monkeypatch):
    """The split-K workspace configs (table and heuristic) reduce "last" unless
    PAGEDLLM_SWAP_LAST_REDUCE=0; unsplit ones stay. SwapConfig refuses other reduces."""
    from pagedllm.kernels import small_m
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    with pytest.raises(ValueError, match="reduce"):
        SwapConfig(64, 128, 4, reduce="atomic")
    for env, want in (("", "last"), ("0", "kernel"), ("1", "last")):
        monkeypatch.setenv("PAGEDLLM_SWAP_LAST_REDUCE", env)
        small_m.last_reduce.cache_clear()
        small_m.default_config.cache_clear()
        try:
            assert small_m.default_config(1, 2048, 4096).reduce == want
            assert small_m.default_config(1, 128, 2048).reduce == want
            assert small_m.default_config(1, 5120, 2048).reduce == "kernel"  # split_k 1
            assert small_m.default_config(1, 3000, 4096).reduce == ("kernel" if small_m.heuristic_config(
                1, 3000, 4096).split_k == 1 else want)
        finally:
            small_m.last_reduce.cache_clear()
            small_m.default_config.cache_clear()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_swap_config_override(monkeypatch):
    """PAGEDLLM_SWAP_CONFIG replaces the table's config for the shapes it names (split-K ones reduced
    by their last split, as the table's), at every row count, and cuBLAS's shapes too; others keep
    theirs; a malformed or invalid entry is a ValueError naming the variable."""
    from pagedllm.kernels import small_m
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    def reread():
        small_m.swap_overrides.cache_clear()
        small_m.default_config.cache_clear()

    o_default = small_m.default_config(1, 2048, 4096)
    try:
        monkeypatch.setenv("PAGEDLLM_SWAP_CONFIG", "5120,2048:64,256,2,4,3;28672,4096:64,128,1,4,4")
        reread()
        assert small_m.default_config(1, 5120, 2048) == SwapConfig(64, 256, 2, 4, 3, reduce="last")
        assert small_m.default_config(16, 5120, 2048) == SwapConfig(64, 256, 2, 4, 3, reduce="last")
        assert small_m.default_config(1, 28672, 4096) == SwapConfig(64, 128, 1, 4, 4)  # cuBLAS's by default
        assert small_m.default_config(1, 2048, 4096) == o_default
        for bad in ("5120,2048:64,256,2,4", "5120,2048:48,256,2,4,3", "5120,2048:64,256,16,4,3",
                    "5120,2048:64,256,2,3,3", "5120:64,256,2,4,3"):
            monkeypatch.setenv("PAGEDLLM_SWAP_CONFIG", bad)
            reread()
            with pytest.raises(ValueError, match="PAGEDLLM_SWAP_CONFIG"):
                small_m.default_config(1, 5120, 2048)
    finally:
        monkeypatch.delenv("PAGEDLLM_SWAP_CONFIG", raising=False)
        reread()
