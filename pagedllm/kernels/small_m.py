"""Dense 16-bit linears of few rows (decode batches of 1-16) through the swap-AB tensor-core
kernel (swap_gemm_triton.py) instead of cuBLAS; `small_m_linear_torch` is the product it must
equal.

Why: at 1-16 rows a projection only streams its weight, and on the H200 cuBLAS reads weights of
8-40 MB at 0.3-3.2 TB/s; this kernel is 5-9% faster on most of those shapes, 1.5x on the MoE
router (float32 logits, no split-K reduce kernel) and 2.4x on Qwen3-0.6B's o projection (the
sweep behind CONFIGS). Larger weights (>= _CUBLAS_MIN_ELEMENTS) and row counts stay on cuBLAS.

On by default: PAGEDLLM_SMALL_M_GEMM unset, 1 or "all" sends the parallel linears and the MoE
router here, "linear" or "router" only one of them, 0 neither. Read once, when a layer is built.
Per shape, `default_config` may answer None (cuBLAS wins there) and the caller keeps F.linear.

On by default since the H200 measured them (RESULTS.md, twelfth session): every split-K config
reduces its workspace in its last program (SwapConfig.reduce "last") rather than in a reduce
kernel, 3-19% faster per layer (PAGEDLLM_SWAP_LAST_REDUCE=0 keeps the kernel); and the MoE
router of 1-16 tokens routes in the GEMM's last program too (`route_small`: no top-k kernel,
5.17 against 5.63 us; PAGEDLLM_FUSED_ROUTER=0 turns it off). Both read once per process.

Nothing here imports triton at module import, so the layers load on a CPU machine without it.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from pagedllm.kernels._triton import next_power_of_2, shape_configs, triton_available

# the kernel's padded row count (swap_gemm_triton.SWAP_BLOCK_M): products of more rows stay on cuBLAS
MAX_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16)
_USES = ("linear", "router")
_MAX_SPLIT_K = 8


def enabled(use: str) -> bool:
    """Whether PAGEDLLM_SMALL_M_GEMM turns the kernel on for `use` ("linear" or "router")."""
    assert use in _USES
    value = os.environ.get("PAGEDLLM_SMALL_M_GEMM", "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("", "1", "all", "true", "yes", "on"):
        return True
    uses = {u.strip() for u in value.split(",")}
    if not uses <= set(_USES):
        raise ValueError(f"PAGEDLLM_SMALL_M_GEMM={value!r}: expected 0, 1, all, or a list of {', '.join(_USES)}")
    return use in uses


# Measured choices per weight shape (N, K) -> [(max rows, config fields or None for cuBLAS), ...]
# in increasing max rows; a config is (block_n, block_k, split_k, num_warps, num_stages[, reduce]).
# From the H200 sweep of benchmarks/small_m_bench.py (RESULTS.md, eleventh session), one config per
# shape for 1-16 rows (the per-row-count bests differed by under 2%); us per layer at 1 row,
# cuBLAS -> this: Qwen3-30B-A3B qkv 8.10 -> 7.71, o 8.50 -> 8.00, router (float32 out) 5.36 ->
# 4.33 (3.61 with float32 atomics, since removed: swap_gemm_triton's docstring); Llama-3.1-8B qkv
# 15.72 -> 14.80, o 12.58 -> 11.83, gate_up and down within 1% (cuBLAS kept); Qwen3-0.6B qkv
# 5.21 -> 4.84, o 12.63 -> 5.24, gate_up 5.96 -> 5.52, down 6.59 -> 5.76.
CONFIGS: dict[tuple[int, int], list[tuple[int, tuple | None]]] = {
    (5120, 2048): [(16, (64, 256, 1, 4, 4))],
    (2048, 4096): [(16, (64, 256, 4, 4, 3))],
    (128, 2048): [(16, (64, 128, 8, 4, 4))],
    (6144, 4096): [(16, (64, 256, 1, 4, 4))],
    (4096, 4096): [(16, (64, 128, 4, 4, 3))],
    (28672, 4096): [(16, None)],
    (4096, 14336): [(16, None)],
    (4096, 1024): [(16, (64, 256, 1, 4, 4))],
    (1024, 2048): [(16, (64, 128, 8, 4, 3))],
    (6144, 1024): [(16, (64, 256, 1, 4, 4))],
    (1024, 3072): [(16, (64, 128, 8, 4, 4))],
}
# weights of this many elements or more stream at cuBLAS's roofline already (Llama-3.1-8B's
# gate_up and down: within 1% in the sweep)
_CUBLAS_MIN_ELEMENTS = 50 << 20
# the sweep's best split-K gave about 64-128 programs, not more: split up to this many
_TARGET_PROGRAMS = 128


def heuristic_config(m: int, n: int, k: int):
    """Shapes the sweep did not measure, fitted to the ones it did: 64-wide weight tiles, 256-wide K
    steps (128 when splitting), and split-K by powers of two while the programs stay within
    _TARGET_PROGRAMS and each split keeps two K steps; 4 stages unsplit, else 3."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    block_n = 64
    tiles = -(-n // block_n)
    split_k = 1
    while 2 * split_k * tiles <= _TARGET_PROGRAMS and split_k < _MAX_SPLIT_K and k >= 2 * 128 * (2 * split_k):
        split_k *= 2
    if split_k == 1:
        return SwapConfig(block_n, 256, 1, num_warps=4, num_stages=4)
    return SwapConfig(block_n, 128, split_k, num_warps=4, num_stages=3)


@functools.cache
def last_reduce() -> bool:
    """Split-K configs reduce in their last program unless PAGEDLLM_SWAP_LAST_REDUCE=0 (read once):
    the swap-AB GEMM and the integer GEMVs (wna16_triton.py)."""
    return os.environ.get("PAGEDLLM_SWAP_LAST_REDUCE", "1").strip() != "0"


def _with_reduce(cfg):
    """cfg, its workspace split-K reduced by its last program when last_reduce() is on."""
    if cfg is None or cfg.split_k == 1 or not last_reduce():
        return cfg
    return dataclasses.replace(cfg, reduce="last")


@functools.cache
def swap_overrides() -> dict[tuple[int, int], tuple[int, ...]]:
    """PAGEDLLM_SWAP_CONFIG (read once; for A/B runs of whole decode steps, where PDL and the kernels
    around a product change what its tiles cost): "N,K:block_n,block_k,split_k,warps,stages" entries
    separated by ";", each the swap-AB kernel's config for an [N, K] weight at every row count it
    takes, in place of CONFIGS' (block_n and block_k powers of 2 >= 16); unset, none. Anything else a
    ValueError naming the variable."""

    def valid(c: tuple) -> bool:
        block_n, block_k, split_k, warps, stages = c
        return (min(block_n, block_k) >= 16 and next_power_of_2(block_n) == block_n
                and next_power_of_2(block_k) == block_k and 1 <= split_k <= _MAX_SPLIT_K
                and warps in (1, 2, 4, 8) and 1 <= stages <= 6)

    return shape_configs("PAGEDLLM_SWAP_CONFIG", "block_n,block_k,split_k,warps,stages", valid)


@functools.cache
def default_config(m: int, n: int, k: int):
    """The SwapConfig for an [m, k] x [n, k].T product, or None where cuBLAS is the better choice
    (swap_overrides' where it names the shape). Cached: every eager decode step asks it once a linear."""
    from pagedllm.kernels.swap_gemm_triton import SwapConfig

    override = swap_overrides().get((n, k))
    if override is not None:
        return _with_reduce(SwapConfig(*override))
    for max_rows, fields in CONFIGS.get((n, k), ()):
        if m <= max_rows:
            return None if fields is None else _with_reduce(SwapConfig(*fields))
    if n * k >= _CUBLAS_MIN_ELEMENTS:
        return None
    return _with_reduce(heuristic_config(m, n, k))


def pick(x: torch.Tensor, weight: torch.Tensor):
    """The kernel's config for `F.linear(x, weight)`, or None where it does not apply (not CUDA, no
    triton, not 2-D, 0 or more than MAX_ROWS rows, not one 16-bit dtype, a weight not contiguous
    along K) or cuBLAS is the better choice for the shape."""
    if not (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and triton_available()
    ):
        return None
    return default_config(x.shape[0], weight.shape[0], weight.shape[1])


def small_m_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The reference: x [M, K] @ weight [N, K].T (+ bias) summed in float32, then cast to
    out_dtype (x's dtype by default)."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)


def small_m_linear(
    x: torch.Tensor,  # [M, K] 16-bit, M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K] x's dtype, unit stride along K
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,  # x's dtype, or torch.float32 (the MoE router's logits)
    config=None,  # a swap_gemm_triton.SwapConfig; default_config's (or the heuristic's) when None
) -> torch.Tensor:  # [M, N]
    from pagedllm.kernels.swap_gemm_triton import swap_gemm

    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.dtype not in _DTYPES:
        raise ValueError(
            f"small_m_linear takes at most {MAX_ROWS} rows of a 16-bit weight (got {m} rows, {weight.dtype})"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    swap_gemm(x, weight, bias, out, config or default_config(m, n, k) or heuristic_config(m, n, k))
    return out


def route_small(
    x: torch.Tensor,  # [T, H] 16-bit, T <= MAX_ROWS
    weight: torch.Tensor,  # [E, H] the router's gate
    top_k: int,
    renormalize: bool,
    config=None,  # a SwapConfig (None: default_config's for the shape, else the heuristic's)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The MoE router and its routing in one launch (swap_gemm_triton.swap_gemm_topk): (logits [T, E]
    float32, topk_weights [T, K] float32, topk_ids [T, K] int64), those of
    topk_softmax(small_m_linear(x, weight, out_dtype=float32)); None where it does not apply (as
    pick(), or more than TOPK_MAX_EXPERTS experts): the caller routes as before."""
    from pagedllm.kernels.swap_gemm_triton import TOPK_MAX_EXPERTS, swap_gemm_topk

    m, k = x.shape if x.dim() == 2 else (0, 0)
    n = weight.shape[0]
    if not (
        x.is_cuda
        and 0 < m <= MAX_ROWS
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
        and top_k <= n <= TOPK_MAX_EXPERTS
        and triton_available()
    ):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m, n, k) or heuristic_config(m, n, k)
    logits = torch.empty((m, n), dtype=torch.float32, device=x.device)
    weights, ids = swap_gemm_topk(x, weight, logits, cfg, top_k, renormalize)
    return logits, weights, ids
