"""The persistent 4-bit MLP kernel (kernels/wna16_chain_triton.py: gate_up, SiLU-and-mul and down in
one launch, a grid barrier between the projections) against the torch reference of the three, and
against itself run a stage a launch, bit for bit (the barrier's test: a program that read the
SiLU-and-mul product before every program had written it would differ); called again with the
barrier's counters left at zero, and replayed from a CUDA graph on new inputs. `check_mlp_chain`
takes a device, so tests/unit/test_wna16_chain_interpret.py runs it on the CPU through Triton's
interpreter at small shapes (a stage a launch there)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_wna16_gpu import _close, _weights  # noqa: E402

from pagedllm.kernels.activation import silu_and_mul_torch  # noqa: E402
from pagedllm.kernels.wna16 import kperm_pack, wna16_linear_torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]


def _mlp(k, i, h, group_k, symmetric, kperm, device, g):
    gu = _weights(2 * i, k, 4, group_k, symmetric, device, g)
    dn = _weights(h, i, 4, group_k, symmetric, device, g)

    def packed(w):
        qw, s, z = w
        return (kperm_pack(qw) if kperm else qw, s, z, kperm)

    return gu, dn, packed(gu), packed(dn)


def _reference(x, gu, dn):
    return wna16_linear_torch(silu_and_mul_torch(wna16_linear_torch(x, *gu, 4)), *dn, 4)


def check_mlp_chain(device, dtype, k, i, h, group_k=128, symmetric=True, kperm=False, config=None, calls=2, seed=0,
                    with_o=False):  # fmt: skip
    """wna16_mlp_chain against the reference, `calls` times on new rows (its counters back at zero
    after each call); on a GPU the persistent launch also against the stage-a-launch one, bit for bit.
    with_o: x [1, k] is the attention's output and o [h, k] and the residual add + RMSNorm come first
    (the MLP's input then h wide)."""
    from pagedllm.kernels.norm import fused_add_rms_norm_torch
    from pagedllm.kernels.wna16_chain_triton import DEFAULT_CONFIG, wna16_mlp_chain

    g = torch.Generator().manual_seed(seed)
    gu, dn, gu_k, dn_k = _mlp(h if with_o else k, i, h, group_k, symmetric, kperm, device, g)
    extra = {}
    if with_o:
        o = _weights(h, k, 4, group_k, symmetric, device, g)
        nw = (1 + 0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype)
        extra = dict(o=(kperm_pack(o[0]) if kperm else o[0], o[1], o[2], kperm), norm=(nw, 1e-5))
    cfg = tuple(config) if config else DEFAULT_CONFIG
    for _ in range(calls):
        x = torch.randn(1, k, generator=g).to(device=device, dtype=dtype)
        if with_o:
            extra["residual"] = torch.randn(1, h, generator=g).to(device=device, dtype=dtype)
            mlp_in, res_ref = fused_add_rms_norm_torch(wna16_linear_torch(x, *o, 4), extra["residual"], nw, 1e-5)
            out, res = wna16_mlp_chain(x, gu_k, dn_k, cfg, **extra)
            assert res.dtype == dtype and res.shape == (1, h)
            _close(res, res_ref, dtype)
        else:
            mlp_in = x
            out = wna16_mlp_chain(x, gu_k, dn_k, cfg)
        assert out.dtype == dtype and out.shape == (1, h)
        _close(out, _reference(mlp_in, gu, dn), dtype)
        if torch.device(device).type == "cuda":
            staged = wna16_mlp_chain(x, gu_k, dn_k, cfg, stages=True, **extra)
            assert all(torch.equal(a, b) for a, b in zip((out, res) if with_o else (out,),
                                                          staged if with_o else (staged,), strict=True)), \
                "the persistent launch differs from a launch a stage"  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,i,h", [(4096, 14336, 4096), (3584, 18944, 3584), (2048, 1000, 1536)])
@pytest.mark.parametrize("group_k,symmetric,kperm", [(128, True, True), (128, False, False), (32, False, False),
                                                     (None, True, False)])  # fmt: skip
def test_mlp_chain(dtype, k, i, h, group_k, symmetric, kperm):
    if kperm and (k % 128 or i % 128):
        pytest.skip("the steps-permuted layout takes whole steps of 128 inputs")
    check_mlp_chain("cuda", dtype, k, i, h, group_k, symmetric, kperm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_k,symmetric,kperm", [(128, True, True), (32, False, False)])
def test_mlp_chain_with_o(dtype, group_k, symmetric, kperm):
    """o, the residual add and RMSNorm in front (Llama-3.1-8B's o and MLP): the persistent launch's
    last o program norms the row for the others."""
    check_mlp_chain("cuda", dtype, 4096, 14336, 4096, group_k, symmetric, kperm, with_o=True)


@pytest.mark.parametrize("config", [(16, 128, 32, 64, 8, 1), (16, 64, 16, 128, 4, 3), (8, 256, 64, 32, 8, 2),
                                    (8, 128, 16, 128, 4, 4)])  # fmt: skip
def test_mlp_chain_configs(config):
    """Other tiles and programs an SM: units of 16 / 8 output pairs, down's 16 / 32 / 64 columns (64: fewer
    units than programs), 4 warps 3 / 4 programs an SM."""
    check_mlp_chain("cuda", torch.bfloat16, 4096, 14336, 4096, 128, True, True, config)


def test_mlp_chain_under_cuda_graph():
    """Captured once and replayed on new rows copied in (as decode steps are): the replay equals the
    reference on the new rows, twice (the barrier's counters zero again after each replay)."""
    from pagedllm.kernels.wna16_chain_triton import wna16_mlp_chain

    g = torch.Generator().manual_seed(1)
    gu, dn, gu_k, dn_k = _mlp(4096, 14336, 4096, 128, True, True, "cuda", g)
    x = torch.randn(1, 4096, generator=g).to("cuda", torch.bfloat16)
    wna16_mlp_chain(x, gu_k, dn_k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = wna16_mlp_chain(x, gu_k, dn_k)
    for _ in range(2):
        x.copy_(torch.randn(1, 4096, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, _reference(x, gu, dn), torch.bfloat16)


@pytest.mark.parametrize("option", ["MLP_CHAIN", "O_CHAIN"])
def test_engine_mlp_chain_decodes_the_same_tokens(tmp_path, tokenizer_dir, monkeypatch, option):
    """A tiny GPTQ checkpoint (groups of 64, 4 bits) on the GPU with PAGEDLLM_FUSED_MLP_CHAIN=1 (or
    O_CHAIN: o and the add + norm in the kernel too): its decode steps of one request run the MLPs
    through the persistent kernel (counted), the prompts' first tokens come from the same prefill as
    without it, and the greedy tokens that follow are the same nearly everywhere (the kernel's float32
    sums run in another order than gemvp's split-K; one flipped near-tie of a random model's logits
    changes the rest of a sequence)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from conftest import save_tiny_model, tiny_config
    from test_wna16 import FORMATS, GREEDY, PROMPTS, write_checkpoint

    from pagedllm import LLM
    from pagedllm.kernels import wna16_chain_triton

    calls = []
    real = wna16_chain_triton.wna16_mlp_chain
    monkeypatch.setattr(wna16_chain_triton, "wna16_mlp_chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = tiny_config("llama", hidden=256, heads=4, kv_heads=2, layers=2, initializer_range=0.05)
    plain = save_tiny_model(cfg, str(tmp_path / "plain"), tokenizer_dir, seed=3)
    path = write_checkpoint(plain, str(tmp_path / "ckpt"), FORMATS["gptq-g64-sym"])
    tokens = {}
    for on in ("0", "1"):
        monkeypatch.setenv(f"PAGEDLLM_FUSED_{option}", on)
        calls.clear()
        llm = LLM(path, kv_cache_memory="64MiB", max_model_len=256)
        # one request at a time: every decode step is of one row
        tokens[on] = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        assert bool(calls) == (on == "1"), len(calls)
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(tokens["1"], tokens["0"], strict=True):
        assert a[0] == b[0] and sum(x == y for x, y in zip(a, b, strict=True)) >= len(b) // 2, (a, b)
