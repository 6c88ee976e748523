"""Programmatic dependent launch (PAGEDLLM_PDL=1 / prefetch, kernels/pdl_triton.py) on the GPU
(sm_90+; skipped elsewhere): a batch-1 decode layer's chain of our kernels -- residual add + norm,
the swap-AB GEMM (split-K reduced by its last split and by the reduce kernel), decode attention
over splits and its reduce, the fused MoE router and the small-batch experts, the FP8 GEMVs,
SiLU-and-mul -- captured in a CUDA graph with PDL and replayed on new inputs gives what the
same chain gives without PDL, bit for bit; and an engine's greedy tokens are the same with and
without it. A kernel that read or wrote before its wait would race and differ."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_SM90 = (torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
            and torch.cuda.get_device_capability()[0] >= 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_SM90, reason="needs an sm_90+ GPU and triton")]


@pytest.fixture(autouse=True)
def _switches_read_afresh():
    """After each test (and after monkeypatch has put the environment back: set up first, torn down
    last) the cached switches are read again, so that later tests see the environment's values."""
    yield
    from pagedllm.kernels import _triton, fused_moe_small_triton

    _triton._pdl_mode.cache_clear()
    fused_moe_small_triton.down_preload.cache_clear()


def _set_mode(monkeypatch, mode: str) -> None:
    """PAGEDLLM_PDL=mode; "no_moe_preload": 1, with PAGEDLLM_MOE_PRELOAD=0 (else that switch at its
    default, on)."""
    from pagedllm.kernels import _triton, fused_moe_small_triton

    monkeypatch.setenv("PAGEDLLM_PDL", "1" if mode == "no_moe_preload" else mode)
    monkeypatch.setenv("PAGEDLLM_MOE_PRELOAD", "0" if mode == "no_moe_preload" else "")
    _triton._pdl_mode.cache_clear()
    fused_moe_small_triton.down_preload.cache_clear()


def _params(seed: int = 0) -> dict:
    from pagedllm.kernels.fp8 import quantize_fp8_torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to("cuda", torch.bfloat16)

    hidden, heads, d, ctx, bs, experts = 2048, 32, 128, 3000, 16, 32
    blocks = -(-ctx // bs)
    p = {"norm": 1 + rnd(hidden), "wq": rnd(heads * d, hidden), "wo": rnd(hidden, heads * d),
         "k": rnd(blocks, bs, 4, d, std=1.0), "v": rnd(blocks, bs, 4, d, std=1.0),
         "bt": torch.randperm(blocks, generator=g).to("cuda", torch.int32)[None, :],
         "lens": torch.tensor([ctx], dtype=torch.int32, device="cuda"), "ctx": ctx,
         "router": rnd(experts, hidden), "w13": rnd(experts, 2 * 768, hidden), "w2": rnd(experts, hidden, 768)}
    for name, shape in (("f13", (2 * 4096, hidden)), ("f2", (hidden, 4096))):
        p[name], p[name + "_s"] = quantize_fp8_torch(rnd(*shape).float())
        p[name], p[name + "_s"] = p[name].cuda(), p[name + "_s"].cuda()
    return p


def _chain(x: torch.Tensor, res: torch.Tensor, p: dict) -> torch.Tensor:
    from pagedllm.kernels.activation_triton import silu_and_mul_triton
    from pagedllm.kernels.attention_decode import decode_attention_triton
    from pagedllm.kernels.fp8_triton import fp8_gemm_triton
    from pagedllm.kernels.fused_moe_small_triton import fused_experts_small
    from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton
    from pagedllm.kernels.small_m import route_small, small_m_linear
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    h, r = fused_add_rms_norm_triton(x, res, p["norm"], 1e-6)
    # the reduce kernel here, the last split (the default) for wo
    q = small_m_linear(h, p["wq"], config=SwapConfig(64, 128, 4, 4, 3, reduce="kernel")).view(1, 32, 128)
    att = decode_attention_triton(q, p["k"], p["v"], p["bt"], p["lens"], torch.empty_like(q), 0.088,
                                  max_seq_len=p["ctx"], last_reduce=False)
    o = small_m_linear(att.view(1, -1), p["wo"])
    h2, r2 = fused_add_rms_norm_triton(o, r, p["norm"], 1e-6)
    _, weights, ids = route_small(h2, p["router"], 4, True)
    moe = fused_experts_small(h2, p["w13"], p["w2"], weights, ids)
    dense = fp8_gemm_triton(silu_and_mul_triton(fp8_gemm_triton(rms_norm_triton(moe, p["norm"], 1e-6), p["f13"],
                                                                  p["f13_s"])), p["f2"], p["f2_s"])
    return dense + r2


def _replays_equal(chain, inputs: list, refs: list) -> None:
    """chain(x, res) run eagerly on the first inputs (compiling it) equals refs[0]; then captured in
    a CUDA graph and replayed on every input (last first), each replay bit for bit its ref."""
    x, res = inputs[0][0].clone(), inputs[0][1].clone()
    torch.testing.assert_close(chain(x, res), refs[0], atol=0, rtol=0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, res)
    for (xi, ri), ref in zip(reversed(inputs), reversed(refs)):
        x.copy_(xi)
        res.copy_(ri)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def _chain_without_pdl(monkeypatch, mode: str, seed: int):
    """(params, three (x, residual) inputs, the chain's outputs on them with PDL off), PAGEDLLM_PDL
    then set to mode; skips where this triton has no PDL."""
    from pagedllm.kernels import _triton

    p = _params()
    gen = torch.Generator().manual_seed(seed)
    inputs = [(torch.randn(1, 2048, generator=gen).to("cuda", torch.bfloat16),
               torch.randn(1, 2048, generator=gen).to("cuda", torch.bfloat16)) for _ in range(3)]
    _set_mode(monkeypatch, "0")
    plain = [_chain(x, r, p) for x, r in inputs]
    _set_mode(monkeypatch, mode)
    if not _triton.pdl(p["norm"])["PDL"]:
        _set_mode(monkeypatch, "0")
        pytest.skip("this triton has no programmatic dependent launch (tl.extra.cuda.gdc_wait, launch_pdl)")
    return p, inputs, plain


@pytest.mark.parametrize("mode", ["1", "prefetch"])
def test_decode_layer_chain_in_a_cuda_graph(monkeypatch, mode):
    p, inputs, refs = _chain_without_pdl(monkeypatch, mode, 1)
    _replays_equal(lambda x, res: _chain(x, res, p), inputs, refs)
    _set_mode(monkeypatch, "0")


def test_decode_layer_chain_without_moe_preload(monkeypatch):
    """PAGEDLLM_MOE_PRELOAD=0 (the MoE down kernel's loop from its first tile, after its wait): the
    chain within rounding of the default's without PDL (the sums in another order), and its CUDA
    graph's replays bit for bit its eager results."""
    p, inputs, plain = _chain_without_pdl(monkeypatch, "no_moe_preload", 2)
    refs = [_chain(x, r, p) for x, r in inputs]
    for a, b in zip(refs, plain, strict=True):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    _replays_equal(lambda x, res: _chain(x, res, p), inputs, refs)
    _set_mode(monkeypatch, "0")


@pytest.mark.parametrize("mode", ["1", "prefetch"])
def test_engine_greedy_tokens_equal_with_pdl(tmp_path, tokenizer_dir, monkeypatch, mode):
    """A tiny Qwen3-MoE in bf16 (CUDA graphs, decode batches of 1-4): the same greedy tokens with
    PAGEDLLM_PDL=1 (the default, the MoE preload on) or prefetch as without PDL."""
    from moe_utils import save_moe_model, tiny_moe_config
    from test_engine_gpu import prompts_of

    from pagedllm import LLM, SamplingParams

    path, _ = save_moe_model(tiny_moe_config("qwen3_moe", hidden_size=256, num_attention_heads=8,
                                             initializer_range=0.05), str(tmp_path), tokenizer_dir)
    prompts = prompts_of([9, 50, 120, 3], seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for m in ("0", mode):
        _set_mode(monkeypatch, m)
        llm = LLM(path, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.2, max_num_seqs=8)
        tokens[m] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    _set_mode(monkeypatch, "0")
    assert tokens[mode] == tokens["0"]


def _set_wna16(monkeypatch, pdl: str, prefetch: str) -> None:
    from pagedllm.kernels import wna16_triton

    monkeypatch.setenv("PAGEDLLM_WNA16_PDL", pdl)
    monkeypatch.setenv("PAGEDLLM_WNA16_PREFETCH", prefetch)
    wna16_triton.gemv_pdl.cache_clear()
    wna16_triton.gemv_prefetch.cache_clear()


@pytest.mark.parametrize("prefetch", ["1", "3"])
def test_gemvp_chain_under_pdl_in_a_cuda_graph(monkeypatch, prefetch):
    """PAGEDLLM_WNA16_PDL=1: gemvp launched with PDL, its first tile's words loaded before its wait
    (register prefetch; a pipelined loop, 3 stages, launches without PDL), between PDL kernels that write its input
    and read its output -- norm, gemvp, SiLU-and-mul, gemvp split-K summed by its last split --
    captured in a CUDA graph and replayed on new inputs: the same bits as without PDL. A read of
    the activations before the wait would see the last replay's."""
    from pagedllm.kernels import _triton, wna16_triton
    from pagedllm.kernels.activation_triton import silu_and_mul_triton
    from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton
    from pagedllm.kernels.wna16 import quantize_wna16_torch

    g = torch.Generator().manual_seed(2)
    hidden, inter = 2048, 4096
    norm = (1 + torch.randn(hidden, generator=g) * 0.02).to("cuda", torch.bfloat16)

    def weight(n, k, symmetric):
        q = quantize_wna16_torch(torch.randn(n, k, generator=g) * 0.02, 4, 128, symmetric, torch.bfloat16)
        return [t.cuda() if t is not None else None for t in q]

    up, down = weight(2 * inter, hidden, True), weight(hidden, inter, False)

    def chain(x, res):
        h, r = fused_add_rms_norm_triton(x, res, norm, 1e-6)
        a = wna16_triton.wna16_gemm_triton(h, *up, 4)  # the default config: gemvp
        y = wna16_triton.wna16_gemm_triton(silu_and_mul_triton(a), *down, 4,
                                           config=("gemvp", 1, 32, 512, 4, 2, 4), reduce_last=True)
        return y + r

    inputs = [tuple(torch.randn(1, hidden, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
              for _ in range(3)]
    _set_mode(monkeypatch, "1")
    if not _triton.pdl(norm)["PDL"]:
        pytest.skip("this triton has no programmatic dependent launch (tl.extra.cuda.gdc_wait, launch_pdl)")
    _set_wna16(monkeypatch, "0", prefetch)
    refs = [chain(x, r) for x, r in inputs]
    _set_wna16(monkeypatch, "1", prefetch)
    _replays_equal(chain, inputs, refs)
    _set_wna16(monkeypatch, "0", "1")
