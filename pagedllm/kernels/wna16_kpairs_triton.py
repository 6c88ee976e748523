"""The K-packed layout's kpairs GEMM (`wna16_kpairs_gemm`), that layout's default for 48-256 rows
since the nineteenth session, 5-256 since the twenty-second (wna16.LAYOUT_DEFAULT,
wna16.kpairs_min_rows): the weight operand built in wgmma's registers (wna16_pairs_triton.py's
construction); must equal the layout's torch reference.

Nibbles i and i + 4 of word j are inputs 8j + i and 8j + i + 4, so x is permuted once a call
(`kpairs_permutation`, one gather) for each dot to read its rows contiguously: within each K step,
x'[k0 + i * BLOCK_K / 4 + 2j + h] = x[k0 + 8j + i + 4h]; K is padded to whole steps (x' zero there).
In the steps-permuted K-packed layout (`kperm`, PAGEDLLM_WNA16_KPERM; kernels/wna16.py) the weight's
slots are stored in that order instead, and x is read as it is.

How a step's four dots run (`SwapConfig.dots`): "chain" (the 256-row tiles') adds them into one
accumulator, and Triton (3.6, sm_90) then waits for each dot's wgmma before the next one starts
(three `wgmma.wait_group 0` a step: the MMAs never overlap the next operand's construction).
"accs" gives each dot its own accumulator, summed after the loop: the loop keeps seven wgmma groups
in flight (wait_group 7), at four accumulators' registers (64-wide weight tiles of 128 rows or
128-wide ones of 64 rows under 8 warps: 182 / 207 registers, no spills). Each checked on sm_90
by tests/unit/test_wna16_kpairs_interpret.py. "accs2", default_config's for tiles of up to 128 rows
since the twenty-sixth session, adds dots 0 and 2 into one accumulator and 1 and 3 into another: two
waits a step instead of three (Triton 3.6 waits after dots 0 and 1; 2 and 3 stay in flight together),
at two accumulators' registers (208 at 128 rows, no spills), so the same tiles as "chain" (256 rows
stay chained). H100, `benchmarks/kpairs_modes.py` (us a layer, 128-row tiles, chain -> accs2): q/k/v
at 192 / 256 rows 41.5 -> 39.9 / 41.3 -> 39.0, gate/up at 96 rows 78.1 -> 73.7, o and down within 2%;
W1 gptq 8,659.6 -> 8,703.8 tok/s (x1.005, two rounds rotated with bf16's 9,159.9).

What a K step costs is not the loads' latency: 3, 4 and 5 stages time the same
(`benchmarks/kpairs_modes.py`, RESULTS.md twenty-fifth session); K steps of 256 inputs at two stages and
two dots an iteration into two accumulators (wait_group 3, the words loaded twice a step) both lost
(the first on the branch exp/kpairs-bk256); one dot an iteration ("flat", the nibble pair a register
shift) was not close to the reference on the H100 (twenty-second session) and is removed.

Stream-K (`SwapConfig.stream_k`, PAGEDLLM_KPAIRS_STREAM_K=1, off: W1 gptq x0.996 on the H100,
twenty-fifth session): the 8-warp tiles hold one CTA an SM, and at 129-256 rows Llama-3.1-8B's q/k/v
makes 96 of them for the 132 SMs (a K step costs a program about 1.4 us however many rows: RESULTS.md
eighteenth session), gate/up 224 of 256 rows (two waves, the second 70% full). `_kpairs_stream_k_kernel`
runs one program an SM, each over an equal share of the (tile, K step) units; a tile shared by several
programs is added by the last of them in K order (deterministic), as the "last program reduces"
kernels do (counters.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import env_flag, inline_ptx, num_sms
from pagedllm.kernels.counters import counters
from pagedllm.kernels.swap_gemm_triton import DOTS_MODES, FP16_MAX, SwapConfig
from pagedllm.kernels.wna16 import KPERM_STEP, group_width, kpairs_permutation, kperm_applies
from pagedllm.kernels.wna16_pairs_triton import (
    _channel_zeros,
    _group_scales,
    _pairs_operand,
)
from pagedllm.kernels.wna16_swap_triton import _int4_epilogue, _k_splits, _split_k, _sum_splits, _tile


@triton.jit
def _step_words(w_ptr, s_ptr, z_ptr, k0, rc, rn, rn64, n_mask, s, zc, K, stride_wk, stride_sg, GROUP_K: tl.constexpr,
                BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr, MAGIC: tl.constexpr, W_DTYPE: tl.constexpr):  # fmt: skip
    """The K step at k0's words [BLOCK_N, BLOCK_K / 4] (columns 2p and 2p + 1 read word p) and its
    (scale, magic + zero) (_group_scales)."""
    kw = k0 // 8 + rc // 2
    w_mask = n_mask[:, None] & (kw < K // 8)[None, :]
    w = tl.load(w_ptr + kw.to(tl.int64)[None, :] * stride_wk + rn[:, None], mask=w_mask, other=0)
    s, zc = _group_scales(s_ptr, z_ptr, rn64, n_mask, w_mask, k0, kw, s, zc, 1, stride_sg, GROUP_K, BLOCK_K,
                          HAS_ZERO, MAGIC, W_DTYPE)  # fmt: skip
    return w, s, zc


@triton.jit
def _x_rows(x_cols, k0, i, rc, m_mask, W_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr, FP16_MAX_: tl.constexpr):
    """x.T's rows of dot i of the K step at k0 (the permuted x's columns k0 + i * BLOCK_C + rc), the
    dot's 16-bit operand (float32 x: fp16, saturated)."""
    xt = tl.load(x_cols + (k0 + i * BLOCK_C + rc)[:, None], mask=m_mask[None, :], other=0.0)
    if xt.dtype != W_DTYPE:
        xt = tl.clamp(xt.to(tl.float32), -FP16_MAX_, FP16_MAX_).to(tl.float16)
    return xt


@triton.jit
def _pairs_dot(w, zc, s, hi, x_cols, k0, I: tl.constexpr, rc, m_mask, acc, W_BF16: tl.constexpr, ASM: tl.constexpr,
               BLOCK_C: tl.constexpr, FP16_MAX_: tl.constexpr):  # fmt: skip
    """acc + dot I of the K step at k0: the words' nibble pair I against x.T's rows (_x_rows)."""
    W_DTYPE: tl.constexpr = tl.bfloat16 if W_BF16 else tl.float16
    xt = _x_rows(x_cols, k0, I, rc, m_mask, W_DTYPE, BLOCK_C, FP16_MAX_)
    return tl.dot(_pairs_operand(w, zc, s, hi, I, W_BF16, ASM), xt, acc)


@triton.jit
def _kpairs_acc(
    x_ptr, w_ptr, s_ptr, z_ptr, rn, n_mask, rn64, rm, m_mask, k_start, k_end, K, stride_xm, stride_wk, stride_sg,
    GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, W_BF16: tl.constexpr, ASM: tl.constexpr, FP16_MAX_: tl.constexpr, DOTS: tl.constexpr,
):  # fmt: skip
    """The float32 product [BLOCK_N, BLOCK_M] of weight rows rn and activation rows rm over the K steps
    in [k_start, k_end) (whole steps), group scales applied in the tile (module docstring)."""
    BLOCK_C: tl.constexpr = BLOCK_K // 4  # a dot's columns: two a word
    W_DTYPE: tl.constexpr = tl.bfloat16 if W_BF16 else tl.float16
    MAGIC: tl.constexpr = 128.0 if W_BF16 else 1024.0
    rc = tl.arange(0, BLOCK_C)
    hi = (rc % 2)[None, :]
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    zc = _channel_zeros(z_ptr, rn64, n_mask, 1, HAS_ZERO, GROUP_K, MAGIC, W_DTYPE, BLOCK_C)
    s = tl.full([BLOCK_N, BLOCK_C], 1.0, W_DTYPE)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if DOTS == "accs" or DOTS == "accs2":
        acc1 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if DOTS == "accs":
        acc2 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, s, zc = _step_words(w_ptr, s_ptr, z_ptr, k0, rc, rn, rn64, n_mask, s, zc, K, stride_wk, stride_sg,
                               GROUP_K, BLOCK_K, HAS_ZERO, MAGIC, W_DTYPE)  # fmt: skip
        if DOTS == "accs2":  # dots 0 and 2 into one accumulator, 1 and 3 into another: pairs of dots in flight
            acc = _pairs_dot(w, zc, s, hi, x_cols, k0, 0, rc, m_mask, acc, W_BF16, ASM, BLOCK_C, FP16_MAX_)
            acc1 = _pairs_dot(w, zc, s, hi, x_cols, k0, 1, rc, m_mask, acc1, W_BF16, ASM, BLOCK_C, FP16_MAX_)
            acc = _pairs_dot(w, zc, s, hi, x_cols, k0, 2, rc, m_mask, acc, W_BF16, ASM, BLOCK_C, FP16_MAX_)
            acc1 = _pairs_dot(w, zc, s, hi, x_cols, k0, 3, rc, m_mask, acc1, W_BF16, ASM, BLOCK_C, FP16_MAX_)
        elif DOTS == "accs":  # dot i into its own accumulator: no dot waits for another (module docstring)
            acc = _pairs_dot(w, zc, s, hi, x_cols, k0, 0, rc, m_mask, acc, W_BF16, ASM, BLOCK_C, FP16_MAX_)
            acc1 = _pairs_dot(w, zc, s, hi, x_cols, k0, 1, rc, m_mask, acc1, W_BF16, ASM, BLOCK_C, FP16_MAX_)
            acc2 = _pairs_dot(w, zc, s, hi, x_cols, k0, 2, rc, m_mask, acc2, W_BF16, ASM, BLOCK_C, FP16_MAX_)
            acc3 = _pairs_dot(w, zc, s, hi, x_cols, k0, 3, rc, m_mask, acc3, W_BF16, ASM, BLOCK_C, FP16_MAX_)
        else:
            for i in tl.static_range(4):
                acc = _pairs_dot(w, zc, s, hi, x_cols, k0, i, rc, m_mask, acc, W_BF16, ASM, BLOCK_C, FP16_MAX_)
    if DOTS == "accs":
        acc = (acc + acc1) + (acc2 + acc3)
    if DOTS == "accs2":
        acc = acc + acc1
    return acc


@triton.jit
def _kpairs_kernel(
    x_ptr,  # [M, KP] activations, permuted (kpairs_permutation), KP = K padded to whole K steps
    w_ptr,  # [K/8, N] int32, K-packed (wna16.py)
    s_ptr,  # [G, N] scales
    z_ptr,  # [G, N] zeros in any float dtype (read when HAS_ZERO)
    b_ptr,  # [N] bias (read when HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1) or the float32 workspace [SPLIT_K, M, N]
    M, N, K, KP, K_SPLIT,  # K: the weight's inputs; KP: x''s (K padded); K_SPLIT: a split's range, whole steps
    stride_xm, stride_wk, stride_sg, stride_om,
    GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_BF16: tl.constexpr, ASM: tl.constexpr, FP16_MAX_: tl.constexpr,
    DOTS: tl.constexpr = "chain",  # a step's four dots: SwapConfig.dots (module docstring)
):  # fmt: skip
    pid_k, rn, n_mask, rn64, rm, m_mask = _tile(M, N, BLOCK_M, BLOCK_N)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, KP)  # (the last split may end early)
    acc = _kpairs_acc(x_ptr, w_ptr, s_ptr, z_ptr, rn, n_mask, rn64, rm, m_mask, k_start, k_end, K, stride_xm,
                      stride_wk, stride_sg, GROUP_K, HAS_ZERO, BLOCK_M, BLOCK_N, BLOCK_K, W_BF16, ASM, FP16_MAX_,
                      DOTS)  # fmt: skip
    _int4_epilogue(acc, s_ptr + rn64, b_ptr, out_ptr, rm, rn, n_mask, m_mask, pid_k, M, N, stride_om, GROUP_K,
                   HAS_BIAS, SPLIT_K)  # fmt: skip


@triton.jit
def _kpairs_stream_k_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr,  # as _kpairs_kernel's
    out_ptr,  # [M, N]
    ws_ptr,  # [programs, 2, BLOCK_N, BLOCK_M] float32: each program's partial first and last tiles
    count_ptr,  # [tiles] int32, zero between calls: the programs done with a shared tile
    M, N, K, KP,
    stride_xm, stride_wk, stride_sg, stride_om,
    GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_BF16: tl.constexpr, ASM: tl.constexpr, FP16_MAX_: tl.constexpr, DOTS: tl.constexpr = "chain",
):  # fmt: skip
    """_kpairs_kernel's product, stream-K: the U = tiles x K steps units (tile-major, a tile's row
    tiles adjacent as _tile's grid orders them) cut into P equal ranges, one a program, P = the
    grid (the SMs), so every SM does the same work whatever the tile count (at 129-256 rows
    Llama-3.1-8B's q/k/v has 96 tiles of 128 x 128, gate/up 224 of 128 x 256: 73% / 85% of 132 SMs
    busy a wave). A program's range is a tail of one tile, whole tiles, a head of another: a whole
    tile is stored as _kpairs_kernel stores it; a partial one goes to the program's workspace slot
    (0 its first tile, 1 its last), and the last of the tile's programs to count it adds the
    partials in K order (so the sum does not depend on which is last) and stores the tile:

        programs of tile t: pa = max p with start(p) <= t KT .. pb = max p with start(p) < (t + 1) KT,
        start(p) = p U // P; program q's partial of t in slot 0 when start(q) >= t KT, else slot 1."""
    p = tl.program_id(0)
    num_p = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    kt = KP // BLOCK_K  # K steps a tile
    units = tiles_m * tl.cdiv(N, BLOCK_N) * kt
    u_first = p * units // num_p
    u_last = (p + 1) * units // num_p
    u = u_first
    while u < u_last:
        tile = u // kt
        t0 = tile * kt
        seg_end = tl.minimum(u_last, t0 + kt)
        rn = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_mask = rn < N
        m_mask = rm < M
        rn64 = rn.to(tl.int64)
        acc = _kpairs_acc(x_ptr, w_ptr, s_ptr, z_ptr, rn, n_mask, rn64, rm, m_mask, (u - t0) * BLOCK_K,
                          (seg_end - t0) * BLOCK_K, K, stride_xm, stride_wk, stride_sg, GROUP_K, HAS_ZERO, BLOCK_M,
                          BLOCK_N, BLOCK_K, W_BF16, ASM, FP16_MAX_, DOTS)  # fmt: skip
        if (u == t0) & (seg_end == t0 + kt):  # the whole tile here
            _int4_epilogue(acc, s_ptr + rn64, b_ptr, out_ptr, rm, rn, n_mask, m_mask, 0, M, N, stride_om, GROUP_K,
                           HAS_BIAS, 1)  # fmt: skip
        else:
            cells = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            slot = tl.where(u == u_first, 0, 1)
            tl.store(ws_ptr + (p * 2 + slot).to(tl.int64) * (BLOCK_N * BLOCK_M) + cells, acc)
            # every thread's stores before the barrier, the barrier before the count, whose release
            # publishes them at gpu scope (and whose acquire, in the last program, orders its loads)
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            pa = ((t0 + 1) * num_p + units - 1) // units - 1
            pb = ((t0 + kt) * num_p + units - 1) // units - 1
            if done == pb - pa:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for q in range(pa, pb + 1):
                    q_slot = tl.where(q * units // num_p >= t0, 0, 1)
                    # .cg: from the L2, where the other programs' stores are (never a stale L1 line)
                    part = ws_ptr + (q * 2 + q_slot).to(tl.int64) * (BLOCK_N * BLOCK_M) + cells
                    total += tl.load(part, cache_modifier=".cg")
                _int4_epilogue(total, s_ptr + rn64, b_ptr, out_ptr, rm, rn, n_mask, m_mask, 0, M, N, stride_om,
                               GROUP_K, HAS_BIAS, 1)  # fmt: skip
                tl.store(count_ptr + tile, 0)  # zero again for the next call (or graph replay)
        u = seg_end


@functools.cache
def dots_mode() -> str:
    """PAGEDLLM_KPAIRS_DOTS (read once): how default_config's tiles run a step's four dots, "accs2"
    (unset: two accumulators in the tiles of up to 128 rows, the 256-row ones chained; W1 gptq x1.005
    against "chain" on the H100), "chain" (one accumulator in every tile), "accs" (four accumulators,
    in 64- and 128-row tiles that fit them; W1 gptq x0.940), for A/B runs on a GPU; anything else a
    ValueError naming the variable."""
    value = os.environ.get("PAGEDLLM_KPAIRS_DOTS", "").strip() or "accs2"
    if value not in DOTS_MODES:
        raise ValueError(f"PAGEDLLM_KPAIRS_DOTS={value!r}: expected one of {', '.join(DOTS_MODES)}")
    return value


# stream-K takes the 128- and 256-row tiles (8 warps, one CTA an SM) whose programs would leave more
# than this share of a wave's SMs idle
STREAM_K_MAX_IDLE = 0.1


@functools.cache
def stream_k_enabled() -> bool:
    """PAGEDLLM_KPAIRS_STREAM_K=1 (read once; off: W1 gptq x0.996 on the H100): default_config's 128-
    and 256-row tiles run stream-K (_kpairs_stream_k_kernel, one program an SM) where their grid
    would leave SMs idle in its last wave; 0 / unset: the grid as it is."""
    return env_flag("PAGEDLLM_KPAIRS_STREAM_K")


def with_stream_k(cfg: SwapConfig, m: int, n: int) -> SwapConfig:
    """cfg as stream-K over the SMs where stream_k_enabled() and its 128- or 256-row tiles' grid
    leaves more than STREAM_K_MAX_IDLE of its last wave's SMs idle (at 129-256 rows Llama-3.1-8B's
    q/k/v: 96 tiles for 132 SMs, gate/up 224); cfg otherwise."""
    if not stream_k_enabled() or cfg.block_m < 128:
        return cfg
    sms = num_sms()
    programs = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * cfg.split_k
    if programs >= triton.cdiv(programs, sms) * sms * (1 - STREAM_K_MAX_IDLE):
        return cfg
    return dataclasses.replace(cfg, split_k=1, stream_k=sms)


def default_config(m: int, n: int, k: int, group_k: int = 0) -> SwapConfig:
    """64 or 128 activation rows a program (4 / 8 warps; 16 or 32 under 33 rows, from the engine's 5 rows
    on: wna16.kpairs_min_rows), 128-wide weight tiles, K steps of 128;
    split-K as the swap kernels' GEMM tiles, but the 8-warp 128-row tiles split only while the
    programs stay within one an SM. From the H100 sweep (`wna16_bench.py --rows 64 256`, RESULTS.md
    eighteenth session, Llama-3.1-8B int4 g128, us a layer): at 64 rows this was the best of the
    sweep on all four projections; at 256 rows qkv split 1 44.3 against split 2's 56.0, o split 2
    32.5 against split 4's 39.0, and gate_up best with 256-row tiles, 142.4 against 161.3. So more
    than 128 rows of a projection whose 128-wide weight tiles alone fill the 132 SMs (gate_up's 224)
    take 256-row tiles: each weight tile dequantized once for all the rows, no split (the narrower
    qkv and o lost with them: 48.8 / 35.5 against 44.3 / 32.5). So do the long-K projections
    (down's 14,336 inputs), split while the programs stay within 132: at 256 rows split 4 82.5 against
    the 128-row tiles' 90.4 (twentieth session; qkv and o lost there again, 48.9 / 35.3 against 44.0 /
    32.5). Those tiles pipeline two K steps where a step holds several groups (group_k 32 / 64: 256 KB
    of shared memory at three, past sm_90's 227; tests/unit/test_wna16_kpairs_interpret.py compiles
    each)."""
    mode = dots_mode()
    if m > 128 and (-(-n // 128) >= 132 or k >= 8192):
        stages = 2 if 0 < group_k < 128 else 3
        split_k = _split_k(m, n, k, 256, 128, 128, 132)
        # (four or two accumulators of 256 rows: too many registers)
        cfg = SwapConfig(128, 128, split_k, num_warps=8, num_stages=stages, block_m=256, pairs=True,
                         dots="chain")
        return with_stream_k(cfg, m, n)
    if mode == "accs":  # 64-wide weight tiles of 128 rows, 128-wide of 64 rows, 8 warps
        block_m = 64 if m <= 64 else 128
        block_n = 128 if block_m == 64 else 64
        split_k = _split_k(m, n, k, block_m, block_n, 128, 132)
        return with_stream_k(SwapConfig(block_n, 128, split_k, num_warps=8, num_stages=3, block_m=block_m, pairs=True,
                                        dots="accs"), m, n)
    block_m = max(16, triton.next_power_of_2(m)) if m <= 32 else 64 if m <= 64 else 128
    split_k = _split_k(m, n, k, block_m, 128, 128, 264 if block_m <= 64 else 132)
    return with_stream_k(SwapConfig(128, 128, split_k, num_warps=4 if block_m <= 64 else 8, num_stages=3,
                                    block_m=block_m, pairs=True, dots=mode), m, n)


def wna16_kpairs_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # [K/8, N] int32, K-packed 4-bit
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N] or None (symmetric: 8)
    bias: torch.Tensor | None = None,  # [N]
    config: SwapConfig | None = None,
    asm: bool | None = None,  # None: the PTX pairs on a GPU, the plain ops under the interpreter
    kperm: bool = False,  # qweight in the steps-permuted layout (wna16.kperm_pack): x read as it is
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    kw, n = qweight.shape
    assert kw * 8 == k and qweight.stride(1) == 1 and scales.shape[1] == n and scales.stride(1) == 1
    assert zeros is None or (zeros.shape == scales.shape and zeros.stride() == scales.stride())
    group_k = group_width(k, scales.shape[0], 8)
    cfg = config or default_config(m, n, k, group_k)
    block_k = cfg.block_k
    assert block_k % 64 == 0 and cfg.reduce == "kernel", "dots of block_k / 4 >= 16 columns; the reduce kernel"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_padded = triton.cdiv(k, block_k) * block_k
    if kperm:  # the weight's slots already in the order the dots read x
        assert block_k == KPERM_STEP and kperm_applies(k, group_k), "the steps-permuted layout's steps are the K steps"
        xp = x if x.stride(1) == 1 else x.contiguous()
    else:
        xp = x if k_padded == k else torch.nn.functional.pad(x, (0, k_padded - k))
        xp = xp.index_select(1, kpairs_permutation(k_padded, block_k, x.device))
    z = zeros if zeros is not None else scales  # an unused pointer when symmetric
    b = bias if bias is not None else scales  # likewise without a bias
    common = dict(GROUP_K=group_k, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=block_k, W_BF16=x.dtype == torch.bfloat16,
                  ASM=inline_ptx(x.device, x.dtype) if asm is None else asm, FP16_MAX_=FP16_MAX, DOTS=cfg.dots, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip
    strides = (xp.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    if cfg.stream_k:  # cfg.stream_k programs at most, a (tile, K step) unit each at least
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        programs = min(cfg.stream_k, tiles * (k_padded // block_k))
        ws = torch.empty((programs, 2, cfg.block_n, cfg.block_m), dtype=torch.float32, device=x.device)
        _kpairs_stream_k_kernel[(programs,)](xp, qweight, scales, z, b, out, ws, counters(x.device, tiles), m, n, k,
                                             k_padded, *strides, **common)  # fmt: skip
        return out
    k_split, split_k = _k_splits(k_padded, cfg.split_k, block_k)
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else None
    _kpairs_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)](
        xp, qweight, scales, z, b, out if ws is None else ws, m, n, k, k_padded, k_split, *strides,
        SPLIT_K=split_k, **common,
    )  # fmt: skip
    _sum_splits(ws, scales, 1, bias, out, group_k)
    return out
