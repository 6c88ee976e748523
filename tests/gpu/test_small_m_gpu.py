"""The 16-bit small-row GEMM (kernels/small_m.py over swap_gemm_triton.py) against its torch
reference on CUDA (skipped without it): the projection shapes it is meant for at 1-16 rows, float32
output (the MoE router), bias, split-K through the workspace and through atomics, a strided input,
CUDA-graph capture, the layers behind PAGEDLLM_SMALL_M_GEMM, and an engine run with it on.

The `check_*` functions take a device, so tests/unit/test_small_m_interpret.py runs them on the
CPU through Triton's interpreter at small shapes."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]

# against the float32 reference: the output's rounding and the summation order differ
TOL = {torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-3, 1e-3)}
# (N, K): Qwen3-30B-A3B qkv / o / router, Llama-3.1-8B qkv / o / gate_up / down, Qwen3-0.6B
# qkv / o / gate_up / down
SHAPES = [
    (5120, 2048),
    (2048, 4096),
    (128, 2048),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (4096, 1024),
    (1024, 2048),
    (6144, 1024),
    (1024, 3072),
]


def _inputs(m, n, k, dtype, device, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device=device, dtype=dtype)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    return x, w, b, g


def check_small_m_linear(device, dtype, m, n, k, bias=False, out_dtype=None, config=None, seed=0):
    """small_m_linear equals small_m_linear_torch; `config`: SwapConfig fields (None: the default)."""
    from pagedllm.kernels.small_m import small_m_linear, small_m_linear_torch
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    out_dtype = getattr(torch, out_dtype) if isinstance(out_dtype, str) else out_dtype
    cfg = SwapConfig(*config) if config is not None else None
    x, w, b, g = _inputs(m, n, k, dtype, device, bias, seed)
    out = small_m_linear(x, w, b, out_dtype, cfg)
    assert out.dtype == (out_dtype or dtype) and out.shape == (m, n)
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out, small_m_linear_torch(x, w, b, out_dtype), atol=atol, rtol=rtol)
    # a strided input (a column slice of a wider tensor) reads the same rows
    wide = torch.randn(m, k + 8, generator=g).to(device=device, dtype=dtype)
    torch.testing.assert_close(
        small_m_linear(wide[:, :k], w, b, out_dtype, cfg),
        small_m_linear_torch(wide[:, :k], w, b, out_dtype),
        atol=atol,
        rtol=rtol,
    )


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_default_config_on_model_shapes(n, k, m):
    check_small_m_linear("cuda", torch.bfloat16, m, n, k, out_dtype=torch.float32 if n == 128 else None)


@pytest.mark.parametrize(
    "config",
    [
        (64, 128, 1, 4, 3),
        (64, 128, 4, 4, 3),
        (128, 64, 3, 8, 4),
        (32, 256, 8, 4, 2),
        (64, 128, 4, 4, 3, True),
        (32, 128, 8, 4, 3, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_configs_ragged_shape_bias(config, dtype, out_dtype):
    """N not a multiple of BLOCK_N, K not of BLOCK_K (nor of the split's range), 3 and 16 rows."""
    for m in (3, 16):
        check_small_m_linear("cuda", dtype, m, 1000, 1992, bias=True, out_dtype=out_dtype, config=config)


@pytest.mark.parametrize("atomic", [False, True])
def test_cuda_graph_replay(atomic):
    """Captured once (workspace or zeroed buffer from the graph's pool), replayed on new rows."""
    from pagedllm.kernels.small_m import small_m_linear, small_m_linear_torch
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    x, w, b, _ = _inputs(8, 2048, 4096, torch.bfloat16, "cuda", True, 1)
    cfg = SwapConfig(64, 128, 8, atomic=atomic)
    small_m_linear(x, w, b, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, w, b, config=cfg)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.testing.assert_close(out, small_m_linear_torch(x, w, b), atol=1.6e-2, rtol=1.6e-2)


def test_layers_behind_the_switch(monkeypatch):
    """With PAGEDLLM_SMALL_M_GEMM=1 the parallel linears and the router take the kernel at 1-16
    rows (and keep F.linear beyond) with the same results; unset, they never take it."""
    from pagedllm.kernels import small_m
    from pagedllm.model.layers.fused_moe import Router
    from pagedllm.model.layers.linear import ColumnParallelLinear, RowParallelLinear

    calls = []
    real = small_m.small_m_linear
    monkeypatch.setattr(small_m, "small_m_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for env, expect in (("1", True), ("0", False)):
        monkeypatch.setenv("PAGEDLLM_SMALL_M_GEMM", env)
        col = ColumnParallelLinear(1024, 3000, bias=True).cuda().to(torch.bfloat16)
        row = RowParallelLinear(2048, 1024).cuda().to(torch.bfloat16)
        router = Router(1024, 128).cuda().to(torch.bfloat16)
        for layer in (col, row, router):
            torch.nn.init.normal_(layer.weight, std=0.05)
        torch.nn.init.normal_(col.bias, std=0.1)
        for m in (1, 7, 16, 17):
            calls.clear()
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(
                col(x), torch.nn.functional.linear(x, col.weight, col.bias), atol=1.6e-2, rtol=1.6e-2
            )
            x2 = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(row(x2), torch.nn.functional.linear(x2, row.weight), atol=1.6e-2, rtol=1.6e-2)
            logits = router(x)
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, x.float() @ router.weight.float().t(), atol=1e-3, rtol=1e-3)
            assert len(calls) == (3 if expect and m <= small_m.MAX_ROWS else 0), (env, m, len(calls))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_engine_with_small_m_gemm(tmp_path, tokenizer_dir, monkeypatch, arch):
    """The engine (CUDA graphs, decode batches of 1-4) with the kernel on: greedy stays close to
    transformers the way test_engine_gpu.py's bf16 test checks it."""
    from conftest import save_tiny_model, tiny_config
    from test_engine_gpu import _close_enough, hf_generate, prompts_of
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_SMALL_M_GEMM", "1")
    path = save_tiny_model(
        tiny_config(
            arch,
            heads=8,
            kv_heads=2,
            hidden=256,
            layers=3,
            head_dim=64 if arch == "qwen3" else None,
            initializer_range=0.05,
        ),
        str(tmp_path),
        tokenizer_dir,
        seed=4,
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=8)
    prompts = prompts_of([9, 50, 120, 3], seed=5)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5), use_tqdm=False
    )
    for p, o in zip(prompts, outs):
        ref, ref_lps = hf_generate(hf, p, 32)
        _close_enough(o.outputs[0].token_ids, o.outputs[0].logprobs, ref, ref_lps)
