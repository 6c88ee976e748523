"""The K-packed layout's kpairs GEMM (kernels/wna16_kpairs_triton.py) on the CPU: the GPU checks of
tests/gpu/test_wna16_gpu.py (and of wna16_linear's dispatch, test_wna16_dispatch_gpu.py) through Triton's
interpreter at small shapes against the float32
reference (a group a K step, a group a word, per channel through the split-K reduce; zeros, bias;
K not a multiple of the step; 32-, 64- and 128-row tiles; float32 activations through fp16
operands), which runs the pairs' plain ops (the interpreter cannot run PTX); x's permutation; and
the kernel compiled for the H200 with its PTX pairs: wgmma reads the weight from registers and
its main loop has no shared-memory round trip for it."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from test_kernels_interpret import run_under_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (m, n, k, group_k, symmetric) + kwargs; config: SwapConfig fields (block_n, block_k, split_k, warps,
# stages, reduce, block_m, pairs[, dots])
_CASES = {
    "g128_step_bm64": ("check_wna16_kpairs", [40, 128, 256, 128, True], {"config": [64, 128, 1, 4, 1, "kernel", 64,
                                                                                     True]}),
    "g32_per_word_asym_bias": ("check_wna16_kpairs", [70, 96, 256, 32, False],
                               {"bias": True, "config": [64, 64, 1, 4, 1, "kernel", 64, True]}),
    "channel_asym_split2_bias": ("check_wna16_kpairs", [33, 128, 512, None, False],
                                 {"bias": True, "config": [32, 128, 2, 4, 1, "kernel", 64, True]}),
    "g8_ragged_k_bm32": ("check_wna16_kpairs", [17, 64, 200, 8, True], {"config": [64, 64, 1, 4, 1, "kernel", 32,
                                                                                   True]}),
    "g128_asym_split3_bm128": ("check_wna16_kpairs", [130, 128, 384, 128, False],
                               {"config": [128, 128, 3, 8, 1, "kernel", 128, True]}),
    "default_config_ragged": ("check_wna16_kpairs", [50, 40, 320, 64, True], {"bias": True}),
    # 256-row tiles (default_config's for wide outputs past 128 rows), 200 rows in one ragged tile
    "g64_asym_bm256_bias": ("check_wna16_kpairs", [200, 128, 256, 64, False],
                            {"bias": True, "config": [128, 128, 1, 8, 1, "kernel", 256, True]}),
    # 64-wide weight tiles of 128 rows, chained (wna16_bench's sweep over 64 rows)
    "channel_asym_bn64_bm128": ("check_wna16_kpairs", [100, 96, 256, None, False],
                                {"config": [64, 128, 1, 8, 1, "kernel", 128, True]}),
    # four accumulators (SwapConfig.dots): 64-wide weight tiles of 128 rows; 128-wide of 64, split, bias
    "g128_asym_accs_bn64": ("check_wna16_kpairs", [130, 128, 384, 128, False],
                            {"config": [64, 128, 1, 8, 1, "kernel", 128, True, "accs"]}),
    "g32_accs_split2_bias": ("check_wna16_kpairs", [70, 96, 512, 32, True],
                             {"bias": True, "config": [128, 128, 2, 8, 1, "kernel", 64, True, "accs"]}),
    # two accumulators (dots 0 and 2, 1 and 3): 128-row tiles, groups of 128 split 3 with a bias; a
    # group a word in 16-row tiles; stream-K over 5 programs on the steps-permuted layout
    "g128_asym_accs2_split3_bias": ("check_wna16_kpairs", [130, 128, 384, 128, False],
                                    {"bias": True, "config": [128, 128, 3, 8, 1, "kernel", 128, True, "accs2"]}),
    "g32_accs2_bm16_split2": ("check_wna16_kpairs", [12, 64, 512, 32, False],
                              {"config": [64, 128, 2, 4, 1, "kernel", 16, True, "accs2"]}),
    "kperm_channel_accs2_sk5_bias": ("check_wna16_kpairs", [100, 192, 512, None, True],
                                     {"bias": True, "config": [64, 128, 1, 4, 1, "kernel", 64, True, "accs2", 5],
                                      "kperm": True}),
    # the steps-permuted layout: x (a strided view) read as it is; per channel split 3, a group a step
    "kperm_channel_asym_split3_bias": ("check_wna16_kpairs", [33, 64, 384, None, False],
                                       {"bias": True, "config": [64, 128, 3, 4, 1, "kernel", 32, True],
                                        "kperm": True}),
    # default_config's 16- and 32-row tiles (PAGEDLLM_WNA16_KPAIRS_FROM below 33 rows)
    "default_config_m5": ("check_wna16_kpairs", [5, 64, 256, 128, True], {}),
    "default_config_m24_channel_bias": ("check_wna16_kpairs", [24, 96, 384, None, False], {"bias": True}),
    # stream-K (SwapConfig.stream_k programs): 6 tiles x 4 K steps over 5 programs (a tile's tail, whole
    # tiles, a head), over 11 (programs inside one tile, three to a tile), over 48 (capped at the 24 units)
    "g128_sk5_bm64": ("check_wna16_kpairs", [100, 192, 512, 128, True],
                      {"config": [64, 128, 1, 4, 1, "kernel", 64, True, "chain", 5]}),
    "channel_asym_sk11_bias": ("check_wna16_kpairs", [100, 192, 512, None, False],
                               {"bias": True, "config": [64, 128, 1, 4, 1, "kernel", 64, True, "chain", 11]}),
    "g32_asym_sk48_ragged_k": ("check_wna16_kpairs", [70, 160, 448, 32, False],
                               {"config": [64, 128, 1, 4, 1, "kernel", 32, True, "chain", 48]}),
    "g128_accs_sk7_bm128": ("check_wna16_kpairs", [130, 128, 384, 128, False],
                            {"config": [64, 128, 1, 8, 1, "kernel", 128, True, "accs", 7]}),
    "kperm_channel_sk3_bias": ("check_wna16_kpairs", [33, 64, 384, None, False],
                               {"bias": True, "config": [64, 128, 1, 4, 1, "kernel", 32, True, "chain", 3],
                                "kperm": True}),
    # two splits of 256 over 384 inputs: the last split's steps past x' read nothing (NaN there)
    "split_past_the_end": ("check_wna16_kpairs", [24, 64, 384, 128, False],
                           {"config": [64, 128, 2, 4, 1, "kernel", 32, True], "nan_past_end": True}),
}
# wna16_linear's dispatch over the kernels (tests/gpu/test_wna16_dispatch_gpu.py)
_DISPATCH_CASES = {
    # the engine's dispatch at every row class, both layouts (kpairs from 5 rows, the default; from 2)
    "dispatch_g128_asym": ("check_wna16_dispatch", [64, 256, [1, 3, 5, 20, 48, 100, 300], 128, False], {}),
    "dispatch_channel_from2": ("check_wna16_dispatch", [64, 256, [2, 5, 20, 40], None, True], {"kpairs_from": 2}),
    "dispatch_g128_asym_stream_k": ("check_wna16_dispatch", [64, 256, [100, 200], 128, False], {"stream_k": True}),
    # PAGEDLLM_WNA16_DENSE_FROM: the dequantized weight's GEMM from 64 rows (64 x 256 weights), not past a
    # bound of 10,000 weights (kpairs then)
    "dense_from_64": ("check_wna16_dense_from", [64, 256, [48, 64, 200], "64"], {}),
    "dense_from_64_bounded": ("check_wna16_dense_from", [64, 256, [64, 200], "64:10000"], {}),
}
_DTYPES = ["bfloat16", "float16", "float32"]
_KEYS = [f"{name}:{dt}" for name in _CASES for dt in _DTYPES]
_DISPATCH_KEYS = [f"{name}:{dt}" for name in _DISPATCH_CASES for dt in _DTYPES]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    return run_under_interpreter("test_wna16_gpu.py", {key: _CASES[key.split(":")[0]] for key in _KEYS})


@pytest.fixture(scope="module")
def dispatch_results() -> dict[str, str | None]:
    cases = {key: _DISPATCH_CASES[key.split(":")[0]] for key in _DISPATCH_KEYS}
    return run_under_interpreter("test_wna16_dispatch_gpu.py", cases)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("key", _KEYS)
def test_wna16_kpairs_under_interpreter(interpreter_results, key):
    err = interpreter_results[key]
    assert err is None, err


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("key", _DISPATCH_KEYS)
def test_wna16_dispatch_under_interpreter(dispatch_results, key):
    err = dispatch_results[key]
    assert err is None, err


@pytest.mark.parametrize("k, block_k", [(256, 128), (384, 64)])
def test_permutation_stays_within_each_step(k, block_k):
    """x' = x[:, p] reorders inputs only within their K step (the split-K ranges and the padding
    are whole steps); which input goes where is checked by the kernels' results above."""
    from pagedllm.kernels.wna16 import kpairs_permutation

    p = kpairs_permutation(k, block_k, torch.device("cpu")).view(-1, block_k)
    steps = torch.arange(0, k, block_k)[:, None]
    assert torch.equal(p.sort(dim=1).values, steps + torch.arange(block_k)[None, :])


def _compile_kpairs(x, group_k, has_zero, block_n, block_m, warps, stages, dots="chain"):
    """_kpairs_kernel compiled for sm_90 (inspect_sm90) as a launch of those tiles would compile it."""
    from pagedllm.kernels import wna16_kpairs_triton as kp
    from pagedllm.kernels.inspect_sm90 import compile_sm90

    sig = {"x_ptr": f"*{x}", "w_ptr": "*i32", "s_ptr": f"*{x}", "z_ptr": f"*{x}", "b_ptr": f"*{x}", "out_ptr": f"*{x}",
           "M": "i32", "N": "i32", "K": "i32", "KP": "i32", "K_SPLIT": "i32", "stride_xm": "i32", "stride_wk": "i32",
           "stride_sg": "i32", "stride_om": "i32"}  # fmt: skip
    constexprs = {"GROUP_K": group_k, "HAS_ZERO": has_zero, "HAS_BIAS": True, "SPLIT_K": 1, "BLOCK_M": block_m,
                  "BLOCK_N": block_n, "BLOCK_K": 128, "W_BF16": x == "bf16", "ASM": True, "FP16_MAX_": 65504.0,
                  "DOTS": dots}  # fmt: skip
    return compile_sm90(kp._kpairs_kernel, sig, constexprs, num_warps=warps, num_stages=stages,
                        aligned=("N", "K", "KP", "K_SPLIT", "stride_xm", "stride_wk", "stride_sg", "stride_om"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("x, group_k, has_zero, block_m, warps", [("bf16", 128, False, 128, 8), ("fp16", 128, True, 64, 4),
                                                                 ("bf16", 0, True, 128, 8), ("bf16", 128, False, 256, 8),
                                                                 ("fp16", 32, True, 256, 8), ("bf16", 128, False, 16, 4),
                                                                 ("fp16", 0, True, 32, 4)])  # fmt: skip
def test_kpairs_kernel_builds_the_operand_in_registers(x, group_k, has_zero, block_m, warps):
    """default_config's tiles (their dots mode) compiled for the H200: wgmma takes the weight from
    registers (its A operand four registers),
    the pairs made by one lop3 with the magic number, no spills, and the main loop without the
    tile's ldmatrix or 128-bit shared stores (no round trip of the operand through shared memory);
    at default_config's stages, within sm_90's 227 KB of shared memory a program."""
    from test_wna16_swap_interpret import pairs_main_loop

    from pagedllm.kernels import wna16_kpairs_triton as kp
    from pagedllm.kernels.inspect_sm90 import resources

    cfg = kp.default_config(block_m, 28672 if block_m == 256 else 6144, 4096, group_k)
    assert (cfg.block_m, cfg.num_warps, cfg.dots) == (block_m, warps, "chain" if block_m == 256 else "accs2")
    compiled = _compile_kpairs(x, group_k, has_zero, 128, block_m, warps, cfg.num_stages, cfg.dots)
    assert resources(compiled)["shared"] <= 232448, resources(compiled)
    count = pairs_main_loop(compiled, x)
    # the plain swap kernel's round trip is STS.128 + LDSM.16.M88 of the whole tile; a group scale
    # vector may come through one transposing LDSM (.MT88), one a group of the K step
    assert count["HGMMA"] > 0 and count["LDSM.16.M88."] == 0 and count["STS.128"] == 0, count
    assert count["LDSM.16.MT88"] <= (128 // group_k if 0 < group_k < 128 else 1), count


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("x, group_k, has_zero, block_n, block_m, dots",
                         [("bf16", 128, False, 64, 128, "accs"), ("fp16", 32, True, 64, 128, "accs"),
                          ("bf16", 0, True, 128, 64, "accs"), ("bf16", 128, False, 128, 128, "accs2"),
                          ("fp16", 32, True, 128, 128, "accs2"), ("bf16", 0, True, 128, 64, "accs2")])  # fmt: skip
def test_kpairs_dots_keep_the_mmas_in_flight(x, group_k, has_zero, block_n, block_m, dots):
    """Compiled for the H200 with 8 warps (accs2's 64-row tiles 4): the chained dots wait for every
    wgmma group before the next dot (wait_group 0 three times a step); four accumulators keep seven
    groups in flight (wait_group 7); two accumulators wait
    twice a step (dots 2 and 3 in flight together); each with one full wait after the loop, nothing
    spilled, the weight still built in registers."""
    from test_wna16_swap_interpret import pairs_main_loop

    from pagedllm.kernels.inspect_sm90 import resources

    waits = {}
    for mode in ("chain", dots):
        warps = 4 if block_m <= 64 and dots == "accs2" else 8
        compiled = _compile_kpairs(x, group_k, has_zero, block_n, block_m, warps, 2 if block_m == 256 else 3, mode)
        ptx = compiled.asm["ptx"]
        waits[mode] = sorted(int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx))
        if mode == dots:
            assert resources(compiled)["stack"] == 0 and resources(compiled)["shared"] <= 232448, resources(compiled)
            count = pairs_main_loop(compiled, x)
            assert count["HGMMA"] > 0 and count["LDSM.16.M88."] == 0 and count["STS.128"] == 0, count
    assert waits["chain"].count(0) >= 4, waits["chain"]  # three in the loop, one after it
    if dots == "accs2":
        assert waits[dots] == [0, 0, 0], waits[dots]  # two in the loop, one after it
        return
    assert waits[dots].count(0) == 1 and set(waits[dots]) == {0, 7}, waits[dots]


def test_dots_switch(monkeypatch):
    """PAGEDLLM_KPAIRS_DOTS: chain the measured tiles; unset or accs2 the same tiles with two
    accumulators; accs their four-accumulator versions below 129 rows (256-row tiles stay chained:
    four or two would not fit their registers); anything else (flat, removed, among them) a
    ValueError naming the variable."""
    from pagedllm.kernels import wna16_kpairs_triton as kp

    try:
        for value, dots in (("", "accs2"), ("chain", "chain"), ("accs", "accs"), ("accs2", "accs2")):
            monkeypatch.setenv("PAGEDLLM_KPAIRS_DOTS", value)
            kp.dots_mode.cache_clear()
            cfg = kp.default_config(100, 6144, 4096, 128)
            assert cfg.dots == dots and (cfg.block_n, cfg.block_m) == ((64, 128) if dots == "accs" else (128, 128))
            assert kp.default_config(64, 6144, 4096, 128).dots == dots
            assert kp.default_config(200, 6144, 4096, 128).dots == dots  # 128-row tiles past 128 rows
            assert kp.default_config(200, 28672, 4096, 128).dots == ("chain" if dots in ("accs", "accs2") else dots)
        for value in ("4", "flat"):  # (flat: one dot an iteration, removed)
            monkeypatch.setenv("PAGEDLLM_KPAIRS_DOTS", value)
            kp.dots_mode.cache_clear()
            with pytest.raises(ValueError, match="PAGEDLLM_KPAIRS_DOTS"):
                kp.default_config(100, 6144, 4096, 128)
    finally:
        kp.dots_mode.cache_clear()


@pytest.mark.parametrize("group_k, symmetric", [(128, False), (None, True), (256, True)])
def test_steps_permuted_layout_holds_the_same_weight(group_k, symmetric):
    """The steps-permuted layout (PAGEDLLM_WNA16_KPERM): nibble i + 4h of word j of each 128-input
    step holds input 32i + 2j + h of it (the order kpairs' dots read x in), and its words dequantize
    (the torch reference, the CPU's linear) to the plain layout's weight."""
    from pagedllm.kernels.wna16 import (
        dequantize_wna16_torch,
        kperm_applies,
        kperm_pack,
        quantize_wna16_torch,
        unpack_rows,
        wna16_linear,
    )

    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 512, generator=g) * 0.05
    qw, s, z = quantize_wna16_torch(w, 4, group_k, symmetric, torch.bfloat16)
    assert kperm_applies(512, group_k or 0)
    qk = kperm_pack(qw)
    plain, slots = unpack_rows(qw, 4), unpack_rows(qk, 4)
    for step in range(4):
        for i in range(4):
            for j in range(16):
                for h in range(2):
                    k0 = 128 * step
                    assert torch.equal(slots[k0 + 8 * j + i + 4 * h], plain[k0 + 32 * i + 2 * j + h])
    assert torch.equal(dequantize_wna16_torch(qk, s, z, 4, torch.float32, kperm=True),
                       dequantize_wna16_torch(qw, s, z, 4, torch.float32))
    x = torch.randn(3, 512, generator=g)
    assert torch.equal(wna16_linear(x, qk, s, z, 4, kperm=True), wna16_linear(x, qw, s, z, 4))
    assert not kperm_applies(512, 64) and not kperm_applies(320, 0)


def _check_switch(monkeypatch, name, read, good, bad):
    """An environment switch read once through the functools.cache'd `read`: each (value, result) of
    `good` read as that result, each value of `bad` a ValueError naming the variable."""
    try:
        for value, want in good:
            monkeypatch.setenv(name, value)
            read.cache_clear()
            assert read() == want, value
        for value in bad:
            monkeypatch.setenv(name, value)
            read.cache_clear()
            with pytest.raises(ValueError, match=name):
                read()
    finally:
        read.cache_clear()


def test_kpairs_from_switch(monkeypatch):
    """PAGEDLLM_WNA16_KPAIRS_FROM: unset, kpairs from 5 rows, the one after gemvp's last (the bound W1
    was measured with); a row count from 2 to
    SWAP_GEMM_MAX_ROWS + 1 (none) moves that bound, and default_config then takes 16- / 32-row tiles
    of 4 warps; anything else a ValueError naming the variable."""
    from pagedllm.kernels import wna16
    from pagedllm.kernels import wna16_kpairs_triton as kp

    _check_switch(monkeypatch, "PAGEDLLM_WNA16_KPAIRS_FROM", wna16.kpairs_min_rows,
                  (("", 5), ("48", 48), ("257", 257)), ("1", "258", "16 rows", "-4"))  # fmt: skip
    for m, block_m in ((5, 16), (16, 16), (17, 32), (32, 32), (33, 64)):
        cfg = kp.default_config(m, 6144, 4096, 128)
        assert (cfg.block_m, cfg.num_warps) == (block_m, 4), (m, cfg)


def test_dense_from_switch(monkeypatch):
    """PAGEDLLM_WNA16_DENSE_FROM: unset or empty, off; ROWS (DENSE_MIN_ROWS to SWAP_GEMM_MAX_ROWS) with
    DENSE_FROM_MAX_WEIGHT, or ROWS:WEIGHTS; anything else a ValueError naming the variable."""
    from pagedllm.kernels import wna16

    _check_switch(monkeypatch, "PAGEDLLM_WNA16_DENSE_FROM", wna16.dense_from,
                  (("", None), ("128", (128, wna16.DENSE_FROM_MAX_WEIGHT)), ("48:1000", (48, 1000)),
                   ("256:0", (256, 0))),
                  ("47", "257", "128:", "128:1e6", "rows", "-64", "64:-1"))  # fmt: skip


def test_stream_k_switch(monkeypatch):
    """PAGEDLLM_KPAIRS_STREAM_K=1 turns default_config's 128- / 256-row tiles to stream-K over the
    SMs (132 without a GPU) where their grid leaves more than a tenth of its last wave idle: at 256
    rows of Llama-3.1-8B q/k/v (96 tiles) and gate/up (224 tiles of 256 rows), not o (64 tiles split
    2: 128 programs) or down (32 of 256 rows split 4), nor few rows; unset, none of them."""
    from pagedllm.kernels import wna16_kpairs_triton as kp

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for value, streamed in (("", set()), ("0", set()), ("1", {"qkv", "gate_up"})):
        monkeypatch.setenv("PAGEDLLM_KPAIRS_STREAM_K", value)
        kp.stream_k_enabled.cache_clear()
        got = {name for name, (n, k) in shapes.items() if kp.default_config(256, n, k, 128).stream_k}
        assert got == streamed, value
        assert not any(kp.default_config(m, n, k, 128).stream_k for m in (5, 24, 48) for n, k in shapes.values())
    cfg = kp.default_config(256, 6144, 4096, 128)
    assert cfg.stream_k == 132 and cfg.split_k == 1 and cfg.block_m == 128
    monkeypatch.setenv("PAGEDLLM_KPAIRS_STREAM_K", "yes")
    kp.stream_k_enabled.cache_clear()
    with pytest.raises(ValueError, match="PAGEDLLM_KPAIRS_STREAM_K"):
        kp.stream_k_enabled()
    kp.stream_k_enabled.cache_clear()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_m, block_n, dots", [(128, 128, "chain"), (256, 128, "chain"), (128, 64, "accs")])
def test_stream_k_kernel_keeps_the_pipelined_mmas(block_m, block_n, dots):
    """_kpairs_stream_k_kernel compiled for sm_90 at the tiles it takes: the K loop inside the
    per-tile loop still wgmma with the weight from registers and cp.async-pipelined loads, nothing
    spilled beyond a few bytes (one CTA an SM: at most 255 registers)."""
    from pagedllm.kernels import wna16_kpairs_triton as kp
    from pagedllm.kernels.inspect_sm90 import compile_sm90, resources

    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KP": "i32",
           "stride_xm": "i32", "stride_wk": "i32", "stride_sg": "i32", "stride_om": "i32"}  # fmt: skip
    constexprs = {"GROUP_K": 128, "HAS_ZERO": False, "HAS_BIAS": True, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "BLOCK_K": 128, "W_BF16": True, "ASM": True, "FP16_MAX_": 65504.0, "DOTS": dots}  # fmt: skip
    k = compile_sm90(kp._kpairs_stream_k_kernel, sig, constexprs, num_warps=8, num_stages=3,
                     aligned=("N", "K", "KP", "stride_xm", "stride_wk", "stride_sg", "stride_om"))
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.cg.shared.global" in ptx
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add\.[us]32", ptx), "no acq_rel gpu-scope count of a shared tile"
    res = resources(k)
    if res is not None:  # (the 256-row tiles: 255 registers, no stack under the device's Triton 3.6, 8 bytes under 3.9)
        assert res["stack"] <= (16 if block_m == 256 else 0) and res["regs"] <= 255, res
