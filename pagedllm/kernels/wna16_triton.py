"""Triton kernels for integer weight-only linears (layout: wna16.py); each equals its torch
reference there.

- `wna16_gemm_triton`: x [M, K] @ dequant(qweight [K/P, N], scales, zeros).T, two kernels:
    gemv / gemvp (few rows): wna16_gemv_triton.py (one word's packed arithmetic: wna16_words_triton.py).
    dot (more rows): [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] through `tl.dot`; the weight tile is
      read as words (each word row serves P rows of the tile), dequantized to the activations'
      dtype with its group's scale, then multiplied.
    dotj (the same product; swept by benchmarks/wna16_bench.py, not yet a default): each word of
      the tile is loaded once ([BLOCK_K / P, BLOCK_N] words, not a word per row of the tile), its
      P values taken apart by shifts and interleaved back into the tile's rows (`_join_rows`);
      with one scale row per tile (per channel, or groups a multiple of BLOCK_K) the tile is
      the exact integers q - zero and the scale multiplies the product instead, once per tile.
- `dequantize_wna16_triton`: the whole weight as [K, N] in a 16-bit dtype (the prefill path).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels._triton import env_flag, inline_ptx, next_power_of_2, num_sms, pdl, shape_configs
from pagedllm.kernels.counters import counters
from pagedllm.kernels.small_m import last_reduce
from pagedllm.kernels.wna16 import GEMV_MAX_ROWS, group_width, kperm_applies, pack_factor
from pagedllm.kernels.wna16_gemv_triton import (  # noqa: F401 (the GEMVs' names, as before the split)
    _MAGIC,
    _MAGIC_F,
    _rows_as_int32_pairs,
    _wna16_gemv_kernel,
    _wna16_gemv_packed_kernel,
    gemv_kind,
    kperm_input,
)


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, k0, kk, rn, k_mask, n_mask, stride_wk, stride_sg,
                  BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr,
                  SCALE_ROWS: tl.constexpr, KPERM: tl.constexpr = False):  # fmt: skip
    """The weight tile [BLOCK_K, BLOCK_N] of inputs kk and outputs rn, as float32 (q - zero)
    times its scale (SCALE_ROWS: one scale row for the tile, read at k0; GROUP_K 0: no
    scale, the caller applies the per-channel one). KPERM: the words in the steps-permuted
    layout, input k read from the slot holding it (every element loads its own word either way),
    for kk = k0 + arange with k0 a multiple of 32 and the tile within one step of 128."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    mask = k_mask[:, None] & n_mask[None, :]
    if KPERM:  # input k0 + r: word 16 (k0 // 128) + (r % 32) // 2, nibble (k0 % 128) // 32 + r // 32 + 4 (r % 2)
        rk = tl.arange(0, kk.shape[0])
        word = (k0 // 128) * 16 + (rk % 32) // 2
        shift = ((k0 % 128) // 32 + rk // 32 + 4 * (rk % 2)) * 4
    else:
        word = kk // P
        shift = (kk % P) * BITS
    w = tl.load(w_ptr + word[:, None] * stride_wk + rn[None, :], mask=mask, other=0)
    q = ((w >> shift[:, None]) & MASK) | _MAGIC
    q = q.to(tl.float32, bitcast=True) - _MAGIC_F
    if GROUP_K == 0:
        if HAS_ZERO:
            q -= tl.load(z_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            q -= 1 << (BITS - 1)
        return q
    if SCALE_ROWS:
        s_off = (k0 // GROUP_K) * stride_sg + rn
        s = tl.load(s_ptr + s_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_ZERO:
            q -= tl.load(z_ptr + s_off, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        s_off = (kk // GROUP_K)[:, None] * stride_sg + rn[None, :]
        s = tl.load(s_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            q -= tl.load(z_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    if not HAS_ZERO:
        q -= 1 << (BITS - 1)
    return q * s


@triton.jit
def _join_rows(w, BITS: tl.constexpr):
    """Words [R, C] int32 -> [R * P, C] float32: row P * r + i holds value i of word row r (its
    bits BITS * i), as unsigned integers (exact)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    v0 = (w & MASK).to(tl.float32)
    v1 = ((w >> BITS) & MASK).to(tl.float32)
    v2 = ((w >> (2 * BITS)) & MASK).to(tl.float32)
    v3 = ((w >> (3 * BITS)) & MASK).to(tl.float32)
    if BITS == 4:
        v4 = ((w >> 16) & MASK).to(tl.float32)
        v5 = ((w >> 20) & MASK).to(tl.float32)
        v6 = ((w >> 24) & MASK).to(tl.float32)
        v7 = ((w >> 28) & MASK).to(tl.float32)
        # tl.join adds its axis last, so the outermost join is the fastest index: bit-reversed tree
        v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        v = v.reshape(w.shape[0], w.shape[1], 8)
    else:
        v = tl.join(tl.join(v0, v2), tl.join(v1, v3)).reshape(w.shape[0], w.shape[1], 4)
    return v.permute(0, 2, 1).reshape(w.shape[0] * (32 // BITS), w.shape[1])


@triton.jit
def _dequant_tile_joined(w_ptr, s_ptr, z_ptr, k0, rn, n_mask, stride_wk, stride_sg,
                         BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr,
                         BLOCK_K: tl.constexpr, SCALE_AFTER: tl.constexpr):  # fmt: skip
    """The weight tile [BLOCK_K, BLOCK_N] of inputs k0 .. k0 + BLOCK_K (K a multiple of BLOCK_K),
    float32, from its words loaded once: q - zero, times the scale of each row's group unless
    SCALE_AFTER (one scale row for the tile, or per channel: the caller scales the product)."""
    P: tl.constexpr = 32 // BITS
    rw = k0 // P + tl.arange(0, BLOCK_K // P)
    w = tl.load(w_ptr + rw[:, None] * stride_wk + rn[None, :], mask=n_mask[None, :], other=0)
    q = _join_rows(w, BITS)
    if SCALE_AFTER:
        if HAS_ZERO:
            z_row = z_ptr + rn
            if GROUP_K > 0:
                z_row += (k0 // GROUP_K) * stride_sg
            q -= tl.load(z_row, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            q -= 1 << (BITS - 1)
        return q
    kk = k0 + tl.arange(0, BLOCK_K)
    s_off = (kk // GROUP_K)[:, None] * stride_sg + rn[None, :]
    s = tl.load(s_ptr + s_off, mask=n_mask[None, :], other=0.0).to(tl.float32)
    if HAS_ZERO:
        q -= tl.load(z_ptr + s_off, mask=n_mask[None, :], other=0.0).to(tl.float32)
    else:
        q -= 1 << (BITS - 1)
    return q * s


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wk, stride_sg, stride_om,
    BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    JOIN: tl.constexpr = False,  # "dotj": each word loaded once (_dequant_tile_joined); needs EVEN_K
    KPERM: tl.constexpr = False,  # the steps-permuted layout: input k from its slot (dotj: slot k meets
    # input kperm_input(k), x gathered)
):  # fmt: skip
    # with JOIN, one scale row per tile multiplies the tile's product, not its weights
    SCALE_AFTER: tl.constexpr = JOIN and (GROUP_K == 0 or GROUP_K % BLOCK_K == 0)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            k_mask = rk < BLOCK_K
        else:
            k_mask = kk < K
        xk = kperm_input(kk) if KPERM and JOIN else kk
        x = tl.load(x_rows + xk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if JOIN:
            w = _dequant_tile_joined(w_ptr, s_ptr, z_ptr, k0, rn, n_mask, stride_wk, stride_sg,
                                     BITS, GROUP_K, HAS_ZERO, BLOCK_K, SCALE_AFTER)
        else:
            w = _dequant_tile(w_ptr, s_ptr, z_ptr, k0, kk, rn, k_mask, n_mask, stride_wk, stride_sg,
                              BITS, GROUP_K, HAS_ZERO, GROUP_K > 0 and GROUP_K % BLOCK_K == 0, KPERM)
        if SCALE_AFTER and GROUP_K > 0:  # q - zero is exact in 16 bits; the group's scale after
            s = tl.load(s_ptr + (k0 // GROUP_K) * stride_sg + rn, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if GROUP_K == 0:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _wna16_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wk, stride_sg, stride_ok,
                          BITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_ZERO: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, KPERM: tl.constexpr = False):  # fmt: skip
    # KPERM: the words in the steps-permuted layout, input k read from its slot
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_mask = kk < K
    w = _dequant_tile(w_ptr, s_ptr, z_ptr, tl.program_id(1) * BLOCK_K, kk, rn, k_mask, n_mask, stride_wk,
                      stride_sg, BITS, GROUP_K, HAS_ZERO, False, KPERM)
    if GROUP_K == 0:
        w = w * tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + kk.to(tl.int64)[:, None] * stride_ok + rn[None, :], w.to(out_ptr.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])


@functools.cache
def gemv_prefetch() -> int | None:
    """How the gemvp (and gemvn) loop keeps loads in flight (PAGEDLLM_WNA16_PREFETCH, read once):
    unset (None), per shape -- gemvp_config's stages for gemvp, the register prefetch elsewhere; 1
    loads the next tile's words before it uses its own (two tiles in flight a thread: the loop's
    loads are not pipelined otherwise; sm_90: the same instructions a word, one register more; W2
    gptq 3.25 -> 3.03 ms/token on the H100, RESULTS.md); 0 neither; 3 or 4 (gemvp) Triton's software
    pipeline of that many stages instead (cp.async through shared memory, 2 / 3 tiles ahead; sm_90 at
    the 32 x 1,024 tile: 52 / 78 KB of shared memory, 28.1 bf16 instructions a word against 25.9;
    benchmarks/sass_counts.py). Set, it applies to every shape."""
    value = os.environ.get("PAGEDLLM_WNA16_PREFETCH", "").strip()
    if not value:
        return None
    if value not in ("0", "1", "3", "4"):
        raise ValueError(f"PAGEDLLM_WNA16_PREFETCH={value!r}: expected 0, 1, 3 or 4")
    return int(value)


@functools.cache
def gemv_pdl() -> bool:
    """gemvp launched with programmatic dependent launch (PAGEDLLM_PDL on too) where it runs
    gemv_prefetch's register prefetch, its first tile's words loaded before it waits for the kernel
    before (read once): on unless PAGEDLLM_WNA16_PDL=0. The H100 (RESULTS.md twenty-second session):
    W2 gptq 2.89 -> 2.69 ms/token, two rounds alternated (at the eighteenth session's tiles it had
    lost, 2.89 -> 2.97, while the pipelined o projection took PDL too and waited before its first load;
    those shapes launch without it)."""
    return env_flag("PAGEDLLM_WNA16_PDL", default=True)


def default_config(m: int, n: int, k: int, group_k: int, bits: int) -> tuple:
    """(kind, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for an [m, k] x [k, n]
    product; BLOCK_K counts inputs (a multiple of 32 // bits). From the H200 sweep of
    benchmarks/wna16_bench.py over Llama-3.1-8B's projections (int4, groups of 128; RESULTS.md):
    one row: 1024-input tiles and 8 warps, the 14336-input down projection split 4 ways; up to 16
    rows 16 x 32 tiles of 128 inputs."""
    if m <= GEMV_MAX_ROWS:
        if k >= 8192:
            return ("gemv", 1, 32, 512, 4, 2, 4)
        return ("gemv", 1, 64 if 4096 < n <= 8192 else 32, 1024, 8, 2, 1)
    if m <= 16:
        return ("dot", 16, 32, 128 if group_k == 0 else min(128, group_k), 4, 3, 1)
    return ("dot", 32, 64, 64 if group_k == 0 else min(64, group_k), 8, 3, 1)


@functools.cache
def gemvp_overrides() -> dict[tuple[int, int], tuple]:
    """PAGEDLLM_GEMVP_CONFIG (read once; for A/B runs of whole decode steps, where PDL and the
    kernels around a GEMV change what its tiles cost): "N,K:block_n,block_k,warps,stages,split"
    entries separated by ";", each gemvp's config for an [N outputs, K inputs] weight in place of
    gemvp_config's (block_k in inputs, 8 times a power of 2; stages 2 the register prefetch, 3-4 the
    pipelined loop); unset, none. Anything else a ValueError naming the variable."""

    def valid(c: tuple) -> bool:
        block_n, block_k, warps, stages, split = c
        return (block_n >= 16 and next_power_of_2(block_n) == block_n and block_k >= 8 and block_k % 8 == 0
                and next_power_of_2(block_k // 8) == block_k // 8 and warps in (1, 2, 4, 8, 16)
                and stages in (2, 3, 4) and split >= 1)

    return {shape: ("gemvp", 1, *c) for shape, c in
            shape_configs("PAGEDLLM_GEMVP_CONFIG", "block_n,block_k,warps,stages,split", valid).items()}


# the 32-column, 1,024-input register-mode tile's programs an SM: 66 registers x 256 threads (sm_90, Triton 3.6)
GEMVP_PROGRAMS_AN_SM = 3
# the 32-column, 512-input tile of 4 warps: 64 registers x 128 threads, 8 programs an SM (sm_90, Triton 3.6)
GEMVP_NARROW_PROGRAMS_AN_SM = 8


def gemvp_config(n: int, k: int) -> tuple:
    """gemvp's one-row config (the default_config tuple; num_stages 3 / 4: the loop's cp.async
    pipeline, 2: gemv_prefetch's register mode) where 4-bit weights meet 16-bit activations and no
    config was given (gemvp_overrides' where it names the shape). From the H100 sweep (`wna16_bench.py
    --rows 1`, RESULTS.md eighteenth session, us a layer, Llama-3.1-8B int4 g128): the 14,336-input
    down projection split 4 ways with 8 warps (15.4 against 18.7 with 4); in whole W2 gptq steps
    (thirty-sixth session, H100) at 1,024-input tiles split as many ways (up to 4) as start in one wave
    (Llama-3.1-8B's down 3: 384 programs, 2.51 -> 2.46 ms/token; 512-input tiles split 3 2.61, the
    1,024-input ones split 2 2.54), 512-input tiles split 4 where not even 2 ways fit. From whole W2 gptq decode
    steps under PDL (twenty-seventh session, H100: 2.64 -> 2.58 ms/token): a projection of at most
    4,096 outputs in the register mode, columns of 32, 1,024-input tiles (its first tile loads before
    the PDL wait; the 4-stage pipeline of 512-input tiles, 7.3 us against 8.5 alone, waits first)
    split 4 ways, or 2 where 4 would not start in one wave of GEMVP_PROGRAMS_AN_SM programs an SM
    (Llama-3.1-8B's o: 256 programs, W2 gptq 2.57 -> 2.51 ms/token on an H100, thirty-fifth
    session); one of up to 8,192 (q/k/v: 96 programs of 64) split 2 ways; a wider one (gate/up) unsplit,
    its 32-column tiles at 4 warps and 512 inputs where they start in one wave of
    GEMVP_NARROW_PROGRAMS_AN_SM an SM (Llama-3.1-8B's 896: W2 gptq 2.47 -> 2.43 and 2.46 -> 2.45 ms/token
    in two H100 calls, thirty-sixth session), else at 8 warps and 1,024."""
    override = gemvp_overrides().get((n, k))
    if override is not None:
        return override
    # the splits of 32-column tiles whose programs all start in one wave (at most 4)
    one_wave = min(4, GEMVP_PROGRAMS_AN_SM * num_sms() // triton.cdiv(n, 32))
    if k >= 8192:
        return ("gemvp", 1, 32, 1024, 8, 2, one_wave) if one_wave >= 2 else ("gemvp", 1, 32, 512, 8, 2, 4)
    if n <= 4096:
        return ("gemvp", 1, 32, 1024, 8, 2, 4 if one_wave == 4 else 2)
    if n <= 8192:
        return ("gemvp", 1, 64, 1024, 8, 2, 2)
    if triton.cdiv(n, 32) <= GEMVP_NARROW_PROGRAMS_AN_SM * num_sms():
        return ("gemvp", 1, 32, 512, 4, 2, 1)
    return ("gemvp", 1, 32, 1024, 8, 2, 1)


def engine_config(m: int, n: int, k: int, group_k: int, bits: int, dtype: torch.dtype, pairs: bool = True) -> tuple:
    """The config wna16_gemm_triton runs when none is given: default_config's, or gemvp_config's
    where gemv_kind takes gemvp for `dtype` (4-bit weights, few rows, rows readable as int32 pairs)."""
    cfg = default_config(m, n, k, group_k, bits)
    if cfg[0] == "gemv" and bits == 4 and pairs and gemv_kind(dtype) == "gemvp":
        return gemvp_config(n, k)
    return cfg


def wna16_gemm_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / P, N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N] or None (symmetric)
    bits: int,
    bias: torch.Tensor | None = None,  # [N]
    config: tuple | None = None,  # see default_config
    reduce_last: bool | None = None,  # gemv split-K: the last split adds the splits (None: small_m.last_reduce)
    kperm: bool = False,  # qweight in the steps-permuted layout (wna16.kperm_pack)
) -> torch.Tensor:  # [M, N] in x's dtype
    p = pack_factor(bits)
    m, k = x.shape
    kw, n = qweight.shape
    assert kw * p == k and qweight.stride(1) == 1 and scales.shape[1] == n and scales.stride(1) == 1
    assert zeros is None or (zeros.shape == scales.shape and zeros.stride() == scales.stride())
    if x.stride(-1) != 1:
        x = x.contiguous()
    group_k = group_width(k, scales.shape[0], p)
    assert not kperm or (bits == 4 and kperm_applies(k, group_k))
    given = config is not None
    kind, block_m, block_n, block_k, num_warps, num_stages, split_k = config or engine_config(
        m, n, k, group_k, bits, x.dtype, _rows_as_int32_pairs(x))
    z = zeros if zeros is not None else scales  # unused pointer when HAS_ZERO is False
    b = bias if bias is not None else scales
    if kind in ("gemv", "gemvp"):
        packed = kind == "gemvp"
        if packed and (bits != 4 or x.dtype not in (torch.float16, torch.bfloat16)):
            raise ValueError(f"the gemvp kernel takes 4-bit weights and 16-bit activations, got {bits} bits "
                             f"and {x.dtype}")
        block_kw = block_k // p
        kw_per_split = triton.cdiv(triton.cdiv(kw, split_k), block_kw) * block_kw
        split_k = triton.cdiv(kw, kw_per_split)
        n_blocks = triton.cdiv(n, block_n)
        last = split_k > 1 and (last_reduce() if reduce_last is None else reduce_last)
        atomics = split_k > 1 and not last
        out = (torch.zeros((m, n), dtype=torch.float32, device=x.device) if atomics
               else torch.empty((m, n), dtype=x.dtype, device=x.device))
        if m == 0:
            return out.to(x.dtype)
        ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if last else out
        count = counters(x.device, m * n_blocks) if last else qweight
        common = dict(GROUP_K=group_k, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, SPLIT_K=split_k,
                      EVEN=kw_per_split * split_k == kw, BLOCK_N=block_n, BLOCK_KW=block_kw, LAST=last,
                      KPERM=kperm, num_warps=num_warps, num_stages=num_stages)  # PDL only where the first
        # tile's words load before the wait (gemv_pdl): with the wait first the H200 measured a loss (W2 gptq,
        # PAGEDLLM_PDL=1: gemv 3.24 -> 3.83, gemvp 2.96 -> 3.00 ms/token)
        if packed:  # the interpreter runs no PTX: the same arithmetic in Triton ops
            if not _rows_as_int32_pairs(x):
                raise ValueError("the gemvp kernel reads activation rows as int32 pairs: each must start "
                                 "4-byte aligned")
            common["ASM"] = inline_ptx(x.device, x.dtype)
            # 3 or 4 stages: the loop's software pipeline (gemvp_config's only while gemv_prefetch
            # leaves the mode per shape); else gemv_prefetch's mode, the register prefetch per shape
            forced = gemv_prefetch()
            mode = num_stages if num_stages >= 3 and (given or forced is None) else (1 if forced is None else forced)
            common["PREFETCH"] = mode == 1
            common["LOOP_STAGES"] = mode if mode >= 3 else 1
            if gemv_pdl() and mode == 1:  # (the pipelined or plain loops would wait first: no overlap)
                common.update(pdl(x))
        else:
            common["BITS"] = bits
        (_wna16_gemv_packed_kernel if packed else _wna16_gemv_kernel)[(m, n_blocks, split_k)](
            x, qweight, scales, z, b, out, ws, count, m, n, kw, kw_per_split,
            x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), **common,
        )  # fmt: skip
        return out.to(x.dtype) if atomics else out
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    assert block_k % p == 0
    join = kind == "dotj"
    if kperm and not join and (128 % block_k or block_k % 32):
        raise ValueError(f"the dot GEMM reads the steps-permuted layout in tiles of 32-128 inputs within a step of "
                         f"128, got BLOCK_K {block_k}")
    if join and (k % block_k or (group_k and group_k % block_k and block_k % group_k)):
        raise ValueError(f"the dotj kernel needs K ({k}) a multiple of BLOCK_K ({block_k}) and groups "
                         f"({group_k}) a multiple or a divisor of it")
    _wna16_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, qweight, scales, z, b, out, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP_K=group_k, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", JOIN=join, KPERM=kperm,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def dequantize_wna16_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                            bits: int, dtype: torch.dtype, kperm: bool = False) -> torch.Tensor:
    """The real weight as [K, N] (the transpose of `dequantize_wna16_torch`'s [N, K]); kperm:
    qweight in the steps-permuted layout (each input read from its slot)."""
    p = pack_factor(bits)
    kw, n = qweight.shape
    k = kw * p
    group_k = group_width(k, scales.shape[0], p)
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_k, block_n = 64, 128
    _wna16_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if zeros is not None else scales, out, n, k,
        qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP_K=group_k, HAS_ZERO=zeros is not None, BLOCK_K=block_k, BLOCK_N=block_n, KPERM=kperm,
        num_warps=4,
    )  # fmt: skip
    return out
