"""GPUs before Hopper. The kernels' tile tables are the H100's / H200's (227 KB of shared memory a
block); on a GPU with less (an A100's 163 KB, an L4's or A10's 99 KB) their launches take fewer
pipeline stages (`_triton.fit_stages`, from each launcher's stage_bytes). Compiled here for those
GPUs: what each launcher would run fits the GPU's shared memory, and on sm_90 the tables' stages are
kept. FP8 weights and KV caches before sm_89 are refused, naming the parameter."""

from __future__ import annotations

import importlib.util

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def test_fp8_refused_before_sm89():
    """An A100 (8.0) compiles none of the FP8 kernels: quantization='fp8' and an FP8 KV cache are a
    ValueError's message naming the parameter there; Ada (8.9) and Hopper take them; 16-bit and 4-bit
    models run on the A100."""
    from pagedllm.worker.worker import fp8_refusal

    weights = fp8_refusal((8, 0), "NVIDIA A100-SXM4-80GB", "fp8", "auto")
    assert weights.startswith("quantization='fp8'") and "A100" in weights and "8.0" in weights
    cache = fp8_refusal((8, 6), "NVIDIA A10", None, "fp8_e4m3")
    assert cache.startswith("kv_cache_dtype='fp8_e4m3'") and "8.6" in cache
    assert fp8_refusal((8, 0), "NVIDIA A100", "gptq", "auto") is None
    assert fp8_refusal((8, 0), "NVIDIA A100", None, "auto") is None
    for capability in ((8, 9), (9, 0), (10, 0)):
        assert fp8_refusal(capability, "GPU", "fp8", "fp8_e5m2") is None

# the shared memory a block may opt in to, by compute capability: H100 / H200, A100, L4 (A10 the same)
LIMITS = {90: 232448, 80: 166912, 89: 101376}


def test_fit_stages():
    from pagedllm.kernels._triton import fit_stages

    assert fit_stages(4, 40960, LIMITS[90], 9) == 4  # sm_90 holds 4 buffers of 4 stages
    assert fit_stages(4, 40960, LIMITS[80], 8) == 4  # before sm_90 3 buffers
    assert fit_stages(4, 40960, LIMITS[89], 8) == 3
    assert fit_stages(2, 300000, LIMITS[89], 8) == 1


def _fitted(stages: int, stage_bytes: int, capability: int) -> int:
    from pagedllm.kernels._triton import fit_stages

    return fit_stages(stages, stage_bytes, LIMITS[capability], capability // 10)


@needs_triton
@pytest.mark.parametrize("capability", [80, 89, 90])
def test_swap_gemm_tables_fit(capability):
    """Every config of the swap-AB table (the 16-bit decode products of 1-16 rows, the MoE router)
    compiled for the GPU at the stages its launcher takes there: within its shared memory."""
    from test_small_m_interpret import swap_constexprs, swap_signature

    from pagedllm.kernels import swap_gemm_triton as s
    from pagedllm.kernels.inspect_sm90 import compile_sm90
    from pagedllm.kernels.small_m import CONFIGS

    configs = {s.SwapConfig(*fields) for rows in CONFIGS.values() for _, fields in rows if fields is not None}
    for cfg in sorted(configs, key=lambda c: (c.block_n, c.block_k, c.split_k, c.num_stages)):
        stages = _fitted(cfg.num_stages, s.stage_bytes(cfg, 2, 2), capability)
        assert capability < 90 or stages == cfg.num_stages
        compiled = compile_sm90(s._swap_kernel, swap_signature("*fp32" if cfg.split_k > 1 else "*bf16"),
                                swap_constexprs(cfg.split_k, cfg.block_n, cfg.block_k), cfg.num_warps, stages,
                                aligned=("N", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_sn", "stride_om"),
                                capability=capability)  # fmt: skip
        assert compiled.metadata.shared <= LIMITS[capability], (cfg, stages, compiled.metadata.shared)


@needs_triton
@pytest.mark.parametrize("capability", [80, 89, 90])
def test_small_moe_tiles_fit(capability):
    """The small-batch MoE kernels' default tiles (gate/up; down at one token and more) at the stages
    their launchers take on the GPU: within its shared memory."""
    from test_fused_moe_interpret import _ALIGNED, _DOWN_SIG, _GATE_UP_SIG, _down_constexprs

    from pagedllm.kernels import fused_moe_small_triton as small
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    cases = [("gate_up", small.DEFAULT_GATE_UP), ("down", small.DEFAULT_DOWN_ONE_TOKEN), ("down", small.DEFAULT_DOWN)]
    for kernel, tiles in cases:
        block_n, block_k, warps, stages = tiles[:4]
        if kernel == "gate_up":
            fn, sig, w_size = small._small_gate_up_kernel, _GATE_UP_SIG, 4
            constexprs = {"HAS_MAP": True, "HAS_LOAD": True, "HAS_SLOTS": True, "EVEN_K": True,
                          "DOT_PRECISION": "tf32"}
        else:
            fn, sig, w_size = small._small_down_kernel, _DOWN_SIG, 2
            constexprs = {"HAS_MAP": True, "EVEN_K": True, "DOT_PRECISION": "tf32", **_down_constexprs(tiles)}
        constexprs.update(BLOCK_N=block_n, BLOCK_K=block_k, PAD_COLS=16)
        fitted = _fitted(stages, small.stage_bytes(block_n, block_k, w_size, 2), capability)
        assert capability < 90 or fitted == stages
        compiled = compile_sm90(fn, sig, constexprs, warps, fitted, aligned=_ALIGNED, capability=capability)
        assert compiled.metadata.shared <= LIMITS[capability], (kernel, tiles, fitted, compiled.metadata.shared)
