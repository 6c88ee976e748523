"""The MoE Triton kernels on the CPU through Triton's interpreter, against their torch
references: the checks of tests/gpu/test_fused_moe.py at small shapes, run in one subprocess by
the runner of test_kernels_interpret.py (TRITON_INTERPRET must be set before triton loads).
float32 and float16 only: the interpreter cannot run bf16 `tl.dot`."""

from __future__ import annotations

import pytest
from test_kernels_interpret import pytestmark, run_under_interpreter  # noqa: F401  (skips without triton)

# name -> (check, dtype, args, kwargs)
_CASES = {
    # uneven loads (3 hot experts), an expert no token picks, equal routing weights, 1 token
    "experts_hot:float32": ("check_fused_experts", [20, 32, 16, 8, 2], {"skew": "hot"}),
    "experts_empty:float16": ("check_fused_experts", [9, 32, 16, 8, 3], {"skew": "one-empty"}),
    "experts_ties:float32": ("check_fused_experts", [6, 32, 16, 4, 2], {"ties": True}),
    "experts_one_token:float32": ("check_fused_experts", [1, 64, 32, 8, 4], {}),
    "experts_ep2:float32": ("check_fused_experts", [12, 32, 16, 8, 2], {"skew": "hot", "ep_ranks": 2}),
    "align:int64": ("check_align", [30, 16, 4, 16], {}),
    "align_ep2:int32": ("check_align", [7, 8, 2, 16], {"ep_ranks": 2}),
    "topk:float32": ("check_topk_softmax", [5, 12, 3, False], {}),
    "topk_renorm_ties:float32": ("check_topk_softmax", [4, 16, 4, True], {"ties": True}),
    # the small-batch path: tensor-core and FMA variants, tokens sharing hot experts, ties, EP
    "small_one_token:float32": ("check_fused_moe_small", [1, 64, 32, 16, 4], {}),
    "small_one_token_fma:float32": ("check_fused_moe_small", [1, 64, 32, 16, 8], {"dot": False}),
    "small_hot:float16": ("check_fused_moe_small", [2, 32, 16, 8, 4], {"skew": "hot"}),
    "small_hot_fma:float16": ("check_fused_moe_small", [2, 32, 16, 8, 4], {"skew": "hot", "dot": False}),
    "small_ties:float32": ("check_fused_moe_small", [3, 40, 24, 8, 2], {"ties": True, "renormalize": False}),
    "small_ep2:float32": ("check_fused_moe_small", [2, 32, 16, 8, 2], {"skew": "one-empty", "ep_ranks": 2}),
    "small_ep2_fma:float32": ("check_fused_moe_small", [2, 32, 16, 8, 2], {"ep_ranks": 2, "dot": False}),
}


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    # the shared runner (it widens only a module's own ELEMENTWISE_TOL; this one has none)
    return run_under_interpreter("test_fused_moe.py", _CASES)


@pytest.mark.parametrize("key", sorted(_CASES))
def test_moe_kernel_under_interpreter(results, key):
    assert results[key] is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{results[key]}"


# Qwen3-30B-A3B's sizes, all multiples of 16 as a real launch sees them
_SMALL_ALIGNED = ("N", "K_dim", "num_experts", "stride_xm", "stride_l", "stride_we", "stride_wn", "stride_hm",
                  "stride_om")


@pytest.mark.parametrize("dot", [True, False])
def test_small_path_kernels_compile_for_sm90(dot):
    """Both kernels of the small-batch path compile for the H200 (errors the interpreter cannot
    show); with `dot`, tensor-core products fed by pipelined weight loads (cp.async). (Triton
    pipelines only the loads that feed a dot: the FMA variant's loads are plain ones.)"""
    from test_fp8_interpret import _compile_sm90

    from pagedllm.kernels import fused_moe_small_triton as f

    gate_up_sig = {"x_ptr": "*bf16", "logits_ptr": "*fp32", "w13_ptr": "*bf16", "h_ptr": "*bf16",
                   "pair_w_ptr": "*fp32", "pair_e_ptr": "*i32", "expert_map_ptr": "*i32", "expert_load_ptr": "*i64",
                   "slot_mapping_ptr": "*i64", "N": "i32", "K_dim": "i32", "num_experts": "i32", "stride_xm": "i32",
                   "stride_l": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_hm": "i32"}
    down_sig = {"h_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16", "pair_w_ptr": "*fp32", "pair_e_ptr": "*i32",
                "N": "i32", "K_dim": "i32", "stride_hm": "i32", "stride_we": "i32", "stride_wn": "i32",
                "stride_om": "i32"}
    common = {"TOP_K": 8, "DOT": dot, "DOT_PRECISION": "tf32", "BLOCK_P": f.SMALL_BLOCK_P}
    bn, bk, nw, ns = f.DEFAULT_CONFIG["gate_up"]
    gate_up = _compile_sm90(f._moe_small_gate_up_kernel, gate_up_sig,
                            {**common, "RENORMALIZE": True, "HAS_MAP": False, "HAS_LOAD": True, "BLOCK_E": 128,
                             "BLOCK_TOPK": 8, "BLOCK_N": bn, "BLOCK_K": bk}, nw, ns, _SMALL_ALIGNED)
    bn, bk, nw, ns = f.DEFAULT_CONFIG["down"]
    down = _compile_sm90(f._moe_small_down_kernel, down_sig, {**common, "BLOCK_N": bn, "BLOCK_K": bk}, nw, ns,
                         _SMALL_ALIGNED)
    for name, compiled in (("gate_up", gate_up), ("down", down)):
        ptx = compiled.asm["ptx"]
        assert ("mma" in ptx) == dot, f"{name}: tensor cores {'missing' if dot else 'used'}"
        assert not dot or "cp.async" in ptx, f"{name}: weight loads not pipelined"
