"""The weight-prefetch plan (worker/weight_prefetch.py) on a tiny model built on the CPU: per
decoder layer, the o projection and then the MLP's linears in the order they run, cut at the
budget; the option's validation. The prefetch itself runs on sm_90 GPUs only
(tests/gpu/test_l2_prefetch_gpu.py)."""

from __future__ import annotations

import pytest

from conftest import tiny_config
from pagedllm.model.models.llama import LlamaForCausalLM
from pagedllm.worker.weight_prefetch import prefetch_budget_bytes, prefetch_plan


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def test_plan_follows_the_layer_and_stops_at_the_budget():
    model = LlamaForCausalLM(tiny_config("llama", hidden=64, layers=3))
    layer = model.model.layers[1]
    o, gu, down = layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight
    budget = _nbytes(o) + _nbytes(gu) // 2
    plan = prefetch_plan(model, budget)
    assert [trigger for trigger, _ in plan] == [lyr.self_attn.qkv_proj for lyr in model.model.layers]
    trigger, spans = plan[1]
    assert [(w is o, w is gu) for w, _ in spans] == [(True, False), (False, True)]
    assert [n for _, n in spans] == [_nbytes(o), _nbytes(gu) // 2]
    whole = prefetch_plan(model, 1 << 40)[2][1]
    assert [w for w, _ in whole] == [model.model.layers[2].self_attn.o_proj.weight,
                                     model.model.layers[2].mlp.gate_up_proj.weight,
                                     model.model.layers[2].mlp.down_proj.weight]
    assert [n for _, n in whole] == [_nbytes(w) for w, _ in whole]


@pytest.mark.parametrize("raw,expected", [("0", 0), ("24", 24_000_000), ("0.5", 500_000)])
def test_budget_from_the_environment(monkeypatch, raw, expected):
    monkeypatch.setenv("PAGEDLLM_L2_PREFETCH_MB", raw)
    assert prefetch_budget_bytes() == expected


@pytest.mark.parametrize("raw", ["-1", "lots"])
def test_bad_budget_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDLLM_L2_PREFETCH_MB", raw)
    with pytest.raises(ValueError, match="PAGEDLLM_L2_PREFETCH_MB"):
        prefetch_budget_bytes()


def test_prefetch_kernel_compiles_for_sm90():
    """The kernel's inline PTX assembles for the H200 (ptxas runs here, no GPU needed): one
    predicated bulk L2 prefetch per chunk, nothing loaded or stored."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedllm.kernels import l2_prefetch as lp

    src = ASTSource(fn=lp._l2_prefetch_kernel, signature={"base": "i64", "nbytes": "i64", "CHUNK_": "constexpr",
                                                          "BLOCK_": "constexpr"},
                    constexprs={"CHUNK_": lp.CHUNK, "BLOCK_": lp.BLOCK})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.prefetch.L2.global" in ptx
    assert "ld.global" not in ptx and "st.global" not in ptx
    assert compiled.asm.get("cubin")
