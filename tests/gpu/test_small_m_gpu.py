"""The 16-bit small-row GEMM (kernels/small_m.py over swap_gemm_triton.py) against its torch
reference on CUDA (skipped without it): the projection shapes it is meant for at 1-16 rows, float32
output (the MoE router), bias, split-K through the workspace (reduced by a kernel or by the last split), a strided input,
CUDA-graph capture, the layers behind PAGEDLLM_SMALL_M_GEMM, and an engine run with it on.

The `check_*` functions take a device, so tests/unit/test_small_m_interpret.py runs them on the
CPU through Triton's interpreter at small shapes."""

from __future__ import annotations

import contextlib
import importlib.util
import os

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


@contextlib.contextmanager
def env_switch(name: str, value: str | None, cached):
    """Environment variable `name` = value within the block (None: as it is), the functools.cache'd
    reader `cached` cleared on entry and after, so that it reads it afresh."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    cached.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
        cached.cache_clear()


def _pool_is_zero(device) -> bool:
    from pagedllm.kernels.counters import counters

    return int(counters(torch.device(device), 1).count_nonzero()) == 0


def check_last_reduce(device, dtype, m, n, k, bias=False, out_dtype=None, config=None, calls=2, seed=0):
    """Split-K reduced by each N tile's last program (SwapConfig.reduce "last") writes what the
    reduce kernel writes, bit for bit (the same adds in the same order), `calls` times in a row
    with new inputs: each call leaves the counters at zero for the next."""
    from pagedllm.kernels.small_m import small_m_linear, small_m_linear_torch
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    out_dtype = getattr(torch, out_dtype) if isinstance(out_dtype, str) else out_dtype
    cfg = SwapConfig(*config[:5], reduce="kernel")
    last = SwapConfig(*config[:5], reduce="last")
    for call in range(calls):
        x, w, b, _ = _inputs(m, n, k, dtype, device, bias, seed + call)
        got = small_m_linear(x, w, b, out_dtype, last)
        assert _pool_is_zero(device), f"call {call} left counters set"
        assert torch.equal(got, small_m_linear(x, w, b, out_dtype, cfg)), f"call {call}: not the reduce kernel's bits"
        atol, rtol = TOL[got.dtype]
        torch.testing.assert_close(got, small_m_linear_torch(x, w, b, out_dtype), atol=atol, rtol=rtol)


def check_router_topk(device, dtype, m, e, k, top_k, renormalize, config=None, ties=False, calls=2, seed=0):
    """The fused router (swap_gemm_topk): its logits are small_m_linear's with the same config, bit for
    bit; its routing is topk_softmax's of those logits (the Triton kernel's ids exactly, ties to the
    lowest id; the weights within float32 rounding of the torch reference); `calls` in a row."""
    from pagedllm.kernels.fused_moe import topk_softmax_torch
    from pagedllm.kernels.fused_moe_triton import topk_softmax_triton
    from pagedllm.kernels.small_m import default_config, heuristic_config, small_m_linear, small_m_linear_torch
    from pagedllm.kernels.swap_gemm_triton import SwapConfig, swap_gemm_topk

    cfg = SwapConfig(*config) if config is not None else default_config(m, e, k) or heuristic_config(m, e, k)
    for call in range(calls):
        x, w, _, _ = _inputs(m, e, k, dtype, device, False, seed + call)
        if ties:  # experts in pairs of equal gate rows: equal logits compete for the last places
            w[1::2] = w[0::2]
        logits = torch.empty(m, e, dtype=torch.float32, device=device)
        weights, ids = swap_gemm_topk(x, w, logits, cfg, top_k, renormalize)
        assert _pool_is_zero(device), f"call {call} left its counter set"
        assert torch.equal(logits, small_m_linear(x, w, None, torch.float32, cfg)), "logits differ"
        torch.testing.assert_close(logits, small_m_linear_torch(x, w, None, torch.float32), atol=1e-3, rtol=1e-3)
        w_kernel, ids_kernel = topk_softmax_triton(logits, top_k, renormalize)
        assert torch.equal(ids, ids_kernel), f"{ids} vs {ids_kernel}"
        w_ref, ids_ref = topk_softmax_torch(logits, top_k, renormalize)
        torch.testing.assert_close(weights, w_ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(weights, w_kernel, atol=1e-6, rtol=1e-5)
        if not ties:
            assert torch.equal(ids, ids_ref)


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
        (64, 128, 4, 4, 3, "last"),
        (32, 128, 8, 4, 3, "last"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_configs_ragged_shape_bias(config, dtype, out_dtype):
    """N not a multiple of BLOCK_N, K not of BLOCK_K (nor of the split's range), 3 and 16 rows."""
    for m in (3, 16):
        check_small_m_linear("cuda", dtype, m, 1000, 1992, bias=True, out_dtype=out_dtype, config=config)


@pytest.mark.parametrize("reduce", ["kernel", "last"])
def test_cuda_graph_replay(reduce):
    """Captured once (the workspace from the graph's pool), replayed on new rows."""
    from pagedllm.kernels.small_m import small_m_linear, small_m_linear_torch
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    x, w, b, _ = _inputs(8, 2048, 4096, torch.bfloat16, "cuda", True, 1)
    cfg = SwapConfig(64, 128, 8, reduce=reduce)
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
    rows (and keep F.linear beyond) with the same results; with 0, they never take it."""
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
    from tiny_models import save_tiny_model, tiny_config
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


@pytest.mark.parametrize("n, k", [(2048, 4096), (4096, 4096), (1024, 2048), (1024, 3072), (128, 2048)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_last_reduce_on_split_k_shapes(n, k, m):
    """The split-K shapes of the table (Qwen3-30B-A3B o and router, Llama-3.1-8B o, Qwen3-0.6B o and
    down) with their configs, reduced by the last split: the reduce kernel's output bit for bit."""
    from pagedllm.kernels import small_m

    fields = small_m.CONFIGS[(n, k)][-1][1]
    check_last_reduce("cuda", torch.bfloat16, m, n, k, out_dtype=torch.float32 if n == 128 else None, config=fields)


@pytest.mark.parametrize("config", [(64, 128, 4, 4, 3), (128, 64, 3, 8, 4), (32, 256, 8, 4, 2)])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_last_reduce_ragged_bias(config, out_dtype):
    for m in (3, 16):
        check_last_reduce("cuda", torch.float16, m, 1000, 1992, bias=True, out_dtype=out_dtype, config=config)


@pytest.mark.parametrize("m", [1, 2, 4, 16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_router_topk_qwen3_moe(m, renormalize, ties):
    """Qwen3-30B-A3B's router (128 experts, hidden 2048, top-8) at its table config, and 60 experts
    (Qwen2-MoE-like, a ragged tile) at the heuristic's."""
    check_router_topk("cuda", torch.bfloat16, m, 128, 2048, 8, renormalize, ties=ties)
    check_router_topk("cuda", torch.float16, m, 60, 1024, 4, renormalize, ties=ties)


@pytest.mark.parametrize("mode", ["last", "router"])
def test_last_program_reduce_replays_in_cuda_graph(mode):
    """Captured once, replayed twice on new rows: each replay is right and leaves the counters at
    zero (an eager call after it is right too)."""
    from pagedllm.kernels.fused_moe import topk_softmax_torch
    from pagedllm.kernels.small_m import route_small, small_m_linear, small_m_linear_torch
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    n, k = (2048, 4096) if mode == "last" else (128, 2048)
    x, w, b, _ = _inputs(4, n, k, torch.bfloat16, "cuda", mode == "last", 1)
    cfg = SwapConfig(64, 128, 4 if mode == "last" else 8, reduce="last")

    def call():
        if mode == "last":
            return (small_m_linear(x, w, b, config=cfg),)
        return route_small(x, w, 8, True)

    call()  # compiles, allocates the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
    for seed in (100, 101):  # not _inputs' seed 1, whose stream made x's rows w's first rows: the
        # other experts' probabilities then fell below float32's normal range and tied at zero
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _pool_is_zero("cuda")
        if mode == "last":
            torch.testing.assert_close(outs[0], small_m_linear_torch(x, w, b), atol=1.6e-2, rtol=1.6e-2)
        else:
            logits = small_m_linear(x, w, None, torch.float32)
            assert torch.equal(outs[0], logits)
            w_ref, ids_ref = topk_softmax_torch(logits, 8, True)
            assert torch.equal(outs[2], ids_ref)
            torch.testing.assert_close(outs[1], w_ref, atol=1e-6, rtol=1e-5)
    eager = call()
    assert torch.equal(eager[0], outs[0])


def test_fused_router_in_the_moe_block(monkeypatch):
    """The MoE block routes 1-16 tokens through route_small (more tokens as before) with the
    unfused block's output; with PAGEDLLM_FUSED_ROUTER=0, never."""
    from pagedllm.distributed import SINGLE
    from pagedllm.kernels import small_m
    from pagedllm.model.layers.fused_moe import SparseMoeBlock

    class Cfg:
        hidden_size = 256

    calls = []
    real = small_m.route_small

    def counted(*a, **kw):  # the calls that routed (None: did not apply)
        out = real(*a, **kw)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(small_m, "route_small", counted)
    blocks = {}
    for env in ("", "0"):
        monkeypatch.setenv("PAGEDLLM_FUSED_ROUTER", env)
        torch.manual_seed(0)
        block = SparseMoeBlock(Cfg, SINGLE, num_experts=32, top_k=4, intermediate_size=64, renormalize=True,
                               expert_parallel=False).cuda().to(torch.bfloat16)
        block.experts.expert_load = block.experts.expert_load.cuda()  # a plain tensor, not a buffer
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.05)
        blocks[env] = block
    blocks["0"].load_state_dict(blocks[""].state_dict())
    for m in (1, 5, 16, 17):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        calls.clear()
        fused = blocks[""](x)
        assert len(calls) == (1 if m <= small_m.MAX_ROWS else 0), (m, calls)
        calls.clear()
        torch.testing.assert_close(fused, blocks["0"](x), atol=1e-2, rtol=1e-2)
        assert not calls
