"""The MoE Triton kernels on the CPU through Triton's interpreter, against their torch
references: the checks of tests/gpu/test_fused_moe.py at small shapes, run in one subprocess by
the runner of test_kernels_interpret.py (TRITON_INTERPRET must be set before triton loads).
float32 and float16 only: the interpreter cannot run bf16 `tl.dot`."""

from __future__ import annotations

import re

import pytest
from test_kernels_interpret import pytestmark, run_under_interpreter  # noqa: F401  (skips without triton)

# name -> (check, dtype, args, kwargs)
_G = {"path": "grouped"}
_S = {"path": "small"}
_TILES_16 = [[16, 16, 4, 1], [16, 16, 4, 1]]  # several n and k tiles of each kernel, no ragged edge
# the down kernel with two experts a program, and with all of a token's (one program adds them)
_TILES_16_PAIRS = [[16, 16, 4, 1], [16, 16, 4, 1, 2]]
_TILES_16_SERIAL = [[16, 16, 4, 1], [16, 16, 4, 1, 8]]
_CASES = {
    # the grouped GEMMs: uneven loads (3 hot experts), an expert no token picks, equal routing
    # weights, 1 token, expert parallelism
    "experts_hot:float32": ("check_fused_experts", [20, 32, 16, 8, 2], {"skew": "hot", **_G}),
    "experts_empty:float16": ("check_fused_experts", [9, 32, 16, 8, 3], {"skew": "one-empty", **_G}),
    "experts_ties:float32": ("check_fused_experts", [6, 32, 16, 4, 2], {"ties": True, **_G}),
    "experts_one_token:float32": ("check_fused_experts", [1, 64, 32, 8, 4], _G),
    "experts_ep2:float32": ("check_fused_experts", [12, 32, 16, 8, 2], {"skew": "hot", "ep_ranks": 2, **_G}),
    # the small-batch kernels: 1, 2, 4 tokens, top-2 and top-8, a token of slot -1 (not counted in
    # the load), ragged tiles (the defaults are wider than these shapes), a repeated expert
    "small_one_token_top8:float32": ("check_fused_experts", [1, 64, 32, 16, 8], {"tiles": _TILES_16, **_S}),
    "small_one_token_top8:float16": ("check_fused_experts", [1, 64, 32, 16, 8], {"tiles": _TILES_16, **_S}),
    "small_two_tokens_hot:float32": ("check_fused_experts", [2, 32, 16, 8, 2], {"skew": "hot", **_S}),
    "small_four_tokens_top8_ep2:float32": ("check_fused_experts", [4, 64, 32, 16, 8],
                                           {"skew": "hot", "ep_ranks": 2, "tiles": _TILES_16, **_S}),
    "small_four_tokens_top8_ep2:float16": ("check_fused_experts", [4, 48, 24, 16, 8],
                                           {"skew": "hot", "ep_ranks": 2, **_S}),
    "small_repeat_ties:float32": ("check_fused_experts", [4, 32, 16, 8, 2], {"skew": "repeat", "ties": True, **_S}),
    # the down kernel's counters: two calls in a row (the first must leave them at zero), experts
    # of another rank (expert_map -1: they add zero and still count), two experts or all k a program
    "small_twice_ep2:float32": ("check_fused_experts", [3, 64, 32, 16, 8],
                                {"ep_ranks": 2, "tiles": _TILES_16, "calls": 2, **_S}),
    "small_pairs_twice_ep4:float32": ("check_fused_experts", [2, 32, 16, 16, 8],
                                      {"skew": "hot", "ep_ranks": 4, "tiles": _TILES_16_PAIRS, "calls": 2, **_S}),
    "small_serial_ep2:float16": ("check_fused_experts", [2, 64, 32, 16, 8],
                                 {"ep_ranks": 2, "tiles": _TILES_16_SERIAL, **_S}),
    # PAGEDLLM_MOE_PRELOAD (on: the down kernel's routing and first weight tile before its wait, that
    # tile added last): one token top-8 split, twice (the counters), experts of another rank, ragged K;
    # and with it off
    "small_preload_twice:float32": ("check_fused_experts", [1, 64, 32, 16, 8],
                                    {"tiles": _TILES_16, "calls": 2, **_S}),
    "small_preload_ep2_ragged:float16": ("check_fused_experts", [1, 48, 24, 16, 8],
                                         {"ep_ranks": 2, "tiles": _TILES_16, **_S}),
    "small_no_preload_twice:float32": ("check_fused_experts", [1, 64, 32, 16, 8],
                                       {"tiles": _TILES_16, "calls": 2, "preload": False, **_S}),
    # the tiles of PAGEDLLM_MOE_GATE_UP_CONFIG / PAGEDLLM_MOE_DOWN_CONFIG at these weights' shapes (w13
    # [16, 64, 64], w2 [16, 64, 32]): 16-wide tiles, the down kernel two experts a program (a split sum)
    "small_env_tiles_twice:float32": ("check_fused_experts", [1, 64, 32, 16, 8],
                                      {"tile_env": ["64,64:16,16,4,1", "64,32:16,16,4,1,2"], "calls": 2, **_S}),
    # fused_experts_triton's choice by the pair count (3 x 2 pairs: the small path)
    "experts_auto:float32": ("check_fused_experts", [3, 32, 16, 8, 2], {}),
    "align:int64": ("check_align", [30, 16, 4, 16], {}),
    "align_ep2:int32": ("check_align", [7, 8, 2, 16], {"ep_ranks": 2}),
    "topk:float32": ("check_topk_softmax", [5, 12, 3, False], {}),
    "topk_renorm_ties:float32": ("check_topk_softmax", [4, 16, 4, True], {"ties": True}),
}


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    # the shared runner (it widens only a module's own ELEMENTWISE_TOL; this one has none)
    return run_under_interpreter("test_fused_moe.py", _CASES)


@pytest.mark.parametrize("key", sorted(_CASES))
def test_moe_kernel_under_interpreter(results, key):
    assert results[key] is None, f"{key} differs from its torch reference under TRITON_INTERPRET=1:\n{results[key]}"


# the small-batch kernels' runtime arguments, as fused_experts_small passes them (bf16 model)
_GATE_UP_SIG = {"x_ptr": "*bf16", "w13_ptr": "*bf16", "h_ptr": "*bf16", "topk_ids_ptr": "*i64",
                "expert_map_ptr": "*i32", "expert_load_ptr": "*i64", "slot_mapping_ptr": "*i64", "inter": "i32",
                "hidden": "i32", "top_k": "i32", "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32",
                "stride_hm": "i32"}
_DOWN_SIG = {"h_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*bf16", "count_ptr": "*i32",
             "topk_ids_ptr": "*i64", "topk_weights_ptr": "*fp32", "expert_map_ptr": "*i32", "hidden": "i32",
             "inter": "i32", "top_k": "i32", "stride_hm": "i32", "stride_we": "i32", "stride_wn": "i32",
             "stride_om": "i32", "stride_pm": "i32"}
_ALIGNED = ("inter", "hidden", "stride_xm", "stride_we", "stride_wn", "stride_hm", "stride_om", "stride_pm")


def _down_constexprs(tiles: tuple, top_k: int = 8) -> dict:
    """The down kernel's constexprs for (BLOCK_N, BLOCK_K, warps, stages[, experts a program]) at top_k."""
    from pagedllm.kernels._triton import next_power_of_2
    from pagedllm.kernels.fused_moe_small_triton import experts_per_program

    per_program = experts_per_program(tiles, top_k)
    return {
        "SPLIT": per_program < top_k,
        "EXPERTS_PER_PROGRAM": per_program,
        "BLOCK_EXPERTS": next_power_of_2(per_program),
    }


@pytest.mark.parametrize(
    "kernel, tiles",
    [("gate_up", "default"), ("gate_up", (32, 128, 4, 4)), ("down", "default"), ("down", "default_one_token"),
     ("down", (32, 256, 2, 4, 2)), ("down", (16, 256, 1, 4, 1))],
)
def test_small_kernels_compile_for_sm90(kernel, tiles):
    """The small-batch kernels compile for the H200 at their default tiles and at wide ones: the
    products on the tensor cores (mma.sync for 16- and 32-row tiles, wgmma from 64), the weight
    loads asynchronous copies (pipelined), nothing spilled. The down kernel's weight tiles get
    num_stages - 1 buffers (its experts are picked out of registers, not loaded in the loop).
    Split over the experts, its programs count on a barrier and an acq_rel atomic at gpu scope
    (the partial products' stores published before the count, the last program's loads of them
    after it, from the L2); with all k experts in one program (8), no atomic."""
    from pagedllm.kernels import fused_moe_small_triton as small
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    if tiles == "default":
        tiles = small.DEFAULT_GATE_UP if kernel == "gate_up" else small.DEFAULT_DOWN
    elif tiles == "default_one_token":
        tiles = small.DEFAULT_GATE_UP if kernel == "gate_up" else small.DEFAULT_DOWN_ONE_TOKEN
    block_n, block_k, num_warps, num_stages = tiles[:4]
    # in the kernels' parameter order
    if kernel == "gate_up":
        fn, sig = small._small_gate_up_kernel, _GATE_UP_SIG
        constexprs = {"HAS_MAP": True, "HAS_LOAD": True, "HAS_SLOTS": True, "EVEN_K": True, "DOT_PRECISION": "tf32"}
    else:
        fn, sig = small._small_down_kernel, _DOWN_SIG
        constexprs = {"HAS_MAP": True, "EVEN_K": True, "DOT_PRECISION": "tf32", **_down_constexprs(tiles)}
    constexprs.update(BLOCK_N=block_n, BLOCK_K=block_k, PAD_COLS=16)
    compiled = compile_sm90(fn, sig, constexprs, num_warps, num_stages, aligned=_ALIGNED)
    ptx = compiled.asm["ptx"]
    assert ("wgmma.mma_async" if block_n >= 64 else "mma.sync.aligned") in ptx
    assert "cp.async" in ptx
    if kernel == "down":
        atom = re.search(r"atom\.global\.gpu\.acq_rel\.add\.[us]32", ptx)
        assert (atom is not None) == constexprs["SPLIT"], "the count's atomic"
        if atom:
            assert "bar.sync" in ptx[: atom.start()].rsplit("st.global", 1)[-1], "no barrier between stores and count"
            assert "ld.global.cg" in ptx[atom.end() :], "the partial products not read from the L2"
    r = resources(compiled)
    if r is None:
        pytest.skip("Triton's cuobjdump is not there")
    assert r["stack"] == 0, r
    if kernel == "down":
        # per buffer: a weight tile and the padded row of h, both bf16
        assert r["shared"] >= (num_stages - 1) * (block_n + 16) * block_k * 2, r


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_float32_default_tiles_fit_shared_memory(kernel):
    """float32 activations (float32 models on a GPU) take default_tiles' narrower float32 tiles,
    whose buffers fit the H200's 227 KiB of shared memory a block (a tile that does not fails at
    launch with OutOfResources: (64, 256, 4, 4) needed 432 KiB in the GPU test; the 16-bit
    default gate/up tile in float32 needs 216 KiB, too near the limit)."""
    import torch

    from pagedllm.kernels import fused_moe_small_triton as small
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    tiles = small.default_tiles(torch.float32)[0 if kernel == "gate_up" else 1]
    assert tiles != small.default_tiles(torch.bfloat16)[0 if kernel == "gate_up" else 1]
    block_n, block_k, num_warps, num_stages = tiles[:4]
    if kernel == "gate_up":
        fn, sig = small._small_gate_up_kernel, dict(_GATE_UP_SIG, x_ptr="*fp32", w13_ptr="*fp32", h_ptr="*fp32")
        constexprs = {"HAS_MAP": True, "HAS_LOAD": True, "HAS_SLOTS": True, "EVEN_K": True, "DOT_PRECISION": "ieee"}
    else:
        fp32 = dict.fromkeys(("h_ptr", "w2_ptr", "out_ptr", "part_ptr"), "*fp32")
        fn, sig = small._small_down_kernel, dict(_DOWN_SIG, **fp32)
        constexprs = {"HAS_MAP": True, "EVEN_K": True, "DOT_PRECISION": "ieee", **_down_constexprs(tiles)}
    constexprs.update(BLOCK_N=block_n, BLOCK_K=block_k, PAD_COLS=16)
    compiled = compile_sm90(fn, sig, constexprs, num_warps, num_stages, aligned=_ALIGNED)
    assert compiled.metadata.shared <= 232448, compiled.metadata.shared


def test_tile_overrides_name_shapes(monkeypatch):
    """PAGEDLLM_MOE_GATE_UP_CONFIG / PAGEDLLM_MOE_DOWN_CONFIG give the small kernels' tiles at the weight
    shapes they name (Qwen3-30B-A3B's w13 [128, 1536, 2048], w2 [128, 2048, 768]); other shapes and
    unset variables keep default_tiles'; a malformed entry is a ValueError naming its variable."""
    import torch

    from pagedllm.kernels import fused_moe_small_triton as small

    w13, w2 = torch.empty(128, 1536, 2048, device="meta"), torch.empty(128, 2048, 768, device="meta")
    other = torch.empty(4, 64, 32, device="meta")
    defaults = small.default_tiles(torch.bfloat16, 1)
    try:
        monkeypatch.setenv("PAGEDLLM_MOE_GATE_UP_CONFIG", "1536,2048:32,128,4,4")
        monkeypatch.setenv("PAGEDLLM_MOE_DOWN_CONFIG", "2048,768:32,256,4,3,2; 64,32:16,16,1,1,8")
        small.tile_overrides.cache_clear()
        assert small.tiles_for(0, torch.bfloat16, 1, w13) == (32, 128, 4, 4) != defaults[0]
        assert small.tiles_for(1, torch.bfloat16, 1, w2) == (32, 256, 4, 3, 2) != defaults[1]
        assert small.tiles_for(1, torch.bfloat16, 1, other) == (16, 16, 1, 1, 8)
        assert small.tiles_for(0, torch.bfloat16, 1, other) == defaults[0]
        assert small.tiles_for(1, torch.bfloat16, 3, w13) == small.default_tiles(torch.bfloat16, 3)[1]
        for name, bad in (("PAGEDLLM_MOE_GATE_UP_CONFIG", "1536,2048:32,128,4"),
                          ("PAGEDLLM_MOE_GATE_UP_CONFIG", "1536,2048:48,128,4,4"),
                          ("PAGEDLLM_MOE_DOWN_CONFIG", "2048,768:32,256,4,3"),
                          ("PAGEDLLM_MOE_DOWN_CONFIG", "2048,768:32,256,3,3,1"),
                          ("PAGEDLLM_MOE_DOWN_CONFIG", "2048,768:32,256,4,3,0")):
            monkeypatch.setenv(name, bad)
            small.tile_overrides.cache_clear()
            with pytest.raises(ValueError, match=name):
                small.tile_overrides()
            monkeypatch.delenv(name)
        small.tile_overrides.cache_clear()
        assert small.tile_overrides() == ({}, {})
    finally:
        small.tile_overrides.cache_clear()
