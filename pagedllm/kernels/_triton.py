"""When to use the Triton kernels: a tensor on CUDA and an importable `triton`; which opt-in
fusions are on; which kernels were compiled. Nothing here imports triton at module import, so
`pagedllm.kernels` loads on a CPU machine without it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when the `triton` package can be found (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """The dispatchers' rule: Triton for CUDA tensors when triton is installed, torch otherwise."""
    return x.is_cuda and triton_available()


def unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as rows [N, H] whose last dimension has unit stride (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def env_flag(name: str, default: bool = False) -> bool:
    """A switch of the environment: 0 off, 1 on, unset or empty `default`; anything else a
    ValueError naming the variable."""
    value = os.environ.get(name, "").strip() or ("1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def shape_configs(name: str, fields: str, valid) -> dict[tuple[int, int], tuple[int, ...]]:
    """Per-shape kernel configs from environment variable `name`: "N,K:<fields>" entries separated by
    ";" (N a weight's outputs, K its inputs, `fields` the config's comma-separated integers, e.g.
    "block_n,block_k,split"), each a tuple for which valid(config) holds; unset, none. Anything else a
    ValueError naming the variable (for A/B runs of whole steps; the kernels' own defaults otherwise)."""
    want = len(fields.split(","))
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(name, "").split(";"))):
        shape, _, cfg = entry.partition(":")
        parts = [p.strip() for p in shape.split(",") + cfg.split(",")]
        if len(parts) != 2 + want or not all(p.isdigit() for p in parts):
            raise ValueError(f"{name}: expected 'N,K:{fields}' entries separated by ';', got {entry!r}")
        n, k, *config = (int(p) for p in parts)
        if not valid(tuple(config)):
            raise ValueError(f"{name}: {entry!r} is not a valid config ({fields})")
        out[(n, k)] = tuple(config)
    return out


def fusion_enabled(option: str, default: bool = True) -> bool:
    """Whether a fused kernel path is on, read when a layer is built: PAGEDLLM_FUSED_<option>=0
    turns it off, =1 on, unset: `default`. ROPE_KV: q/k norm + rotary + store-KV in one kernel
    (kernels/qkv_rope.py), on by default (it runs on CUDA tensors only; the CPU keeps the unfused
    chain). ROUTER: the MoE router's product, softmax and top-k in one launch for 1-16 tokens
    (kernels/small_m.py `route_small`), on by default. ACT_FP8: the gated activation writing an FP8
    down projection's per-token e4m3 rows itself (model/layers/activation.py `act_into`), on by default.
    NORM_FP8: RMSNorm writing the qkv and gate/up products' FP8 rows (layernorm.py `norm_into`), off.
    ROPE_DECODE: in a step of decodes only, the decode attention kernel doing ROPE_KV's work itself
    (attention_decode.py, ROPE: one kernel a layer less), on by default (Qwen3-30B-A3B batch 1 x0.991 on the
    H100; W2 gptq x1.00)."""
    value = os.environ.get(f"PAGEDLLM_FUSED_{option}", "").strip()
    return default if not value else value != "0"


def _compiled_text(hook_kwargs: dict) -> str:
    """The JIT cache hook's kernel: its repr up to the arguments (name and launch options), then
    each constexpr argument's value (the repr's argument types say nothing of them)."""
    text = str(hook_kwargs.get("repr", "?")).split("](", 1)[0] + "]"
    try:
        params = hook_kwargs["fn"].jit_function.params
        constants = hook_kwargs["compile"]["constants"]
        values = [f"{params[path[0]].name}={value}" for path, value in constants.items()
                  if isinstance(path, tuple) and len(path) == 1 and params[path[0]].is_constexpr]  # fmt: skip
    except (AttributeError, IndexError, KeyError, TypeError):  # another Triton's hook arguments
        return str(hook_kwargs.get("repr", "?"))
    return f"{text}({', '.join(values)})"


@contextlib.contextmanager
def recorded_compiles():
    """Yields the list of the Triton kernels this process compiles while inside (each the name
    with its launch options and constexpr values, from Triton's JIT cache hook: _compiled_text),
    or None without triton. A kernel compiled on the serving path (a specialisation no warm-up
    reached) stalls its step for 30-100 ms from Triton's disk cache, about half a second where
    that lacks it too (H100: two decode kernels, a 1,222 ms step, worker/warmup.py)."""
    try:
        from triton import knobs

        old = knobs.runtime.jit_cache_hook
    except (ImportError, AttributeError):  # no triton, or one older than its knobs (3.4)
        yield None
        return
    seen: list[str] = []

    def hook(*args, **kwargs) -> bool:
        seen.append(_compiled_text(kwargs))
        return False  # True would skip the compile

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = old


@functools.cache
def num_sms(device_index: int | None = None) -> int:
    """The SMs of a CUDA device (None: the current one); 132, the H100's and H200's, without CUDA
    (the interpreter's runs of the kernels that size their grids by it)."""
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(
        torch.cuda.current_device() if device_index is None else device_index).multi_processor_count


@functools.cache
def capability_major(device_index: int) -> int:
    """The compute capability's major number of CUDA device `device_index` (9: Hopper)."""
    return torch.cuda.get_device_capability(device_index)[0]


@functools.cache
def shared_memory_limit(device_index: int) -> int:
    """The shared memory a block may opt in to on CUDA device `device_index`, bytes (232,448 on an
    H100 / H200, 166,912 on an A100, 101,376 on an L4 or A10): the figure Triton checks a compiled
    kernel against at launch (its OutOfResources)."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def fit_stages(stages: int, stage_bytes: int, limit: int, capability: int) -> int:
    """The most software-pipeline stages, up to `stages`, whose buffers of `stage_bytes` fit `limit`
    bytes of shared memory: Triton keeps `stages` buffers on sm_90 and `stages` - 1 before it (the
    swap-AB kernel at 64 x 256 tiles, 4 stages: 163,840 bytes compiled for sm_90, 122,880 for sm_80).
    The kernels' tables are the H100's / H200's; an L4's 99 KB would not launch some of them."""
    most = limit // stage_bytes + (0 if capability >= 9 else 1)
    return max(1, min(stages, most))


def stages_for(device: torch.device, stages: int, stage_bytes: int) -> int:
    """fit_stages for a launch on `device` (its shared memory and capability); `stages` off CUDA."""
    if device.type != "cuda":
        return stages
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fit_stages(stages, stage_bytes, shared_memory_limit(index), capability_major(index))


def inline_ptx(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the 4-bit kernels' inline PTX (their ASM switch: the weight words made 16-bit pairs by a
    lop3 and packed arithmetic) applies to `dtype` values on `device`: on CUDA outside Triton's
    interpreter, and for bfloat16 only from sm_90 on -- its sub.rn.bf16x2 / mul.rn.bf16x2 need it, so
    an A100, A10 or L4 (sm_80-89) compiles those kernels' plain-op path instead (the interpreter's,
    checked against the references; float16's f16x2 PTX runs there)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return dtype != torch.bfloat16 or capability_major(device.index or 0) >= 9


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    """Programmatic dependent launch needs an sm_90+ device and a triton with grid dependency
    control (`tl.extra.cuda.gdc_wait`, the `launch_pdl` launch option: 3.4 and later)."""
    if not triton_available() or capability_major(device_index) < 9:
        return False
    try:
        import triton.language.extra.cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait") and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_PDL_MODES = ("0", "1", "prefetch")


@functools.cache
def _pdl_mode() -> str:
    """PAGEDLLM_PDL (read once): 1, the default (kernels launched with programmatic dependent
    launch; H200, thirteenth session: W2 bf16 4.572 -> 4.476, W2 FP8 2.744 -> 2.585, Qwen3-30B-A3B
    batch 1 3.198 -> 2.945 ms/token), 0 (off), prefetch (1, and the small-row GEMMs ask L2 for
    their first weight tiles before they wait; slower than 1 there). (The swap-AB GEMM loading its first
    weight tile into registers before it waits, as gemvp does, timed the same as 1 in the twenty-sixth
    session and was removed: branch exp/swap-preload.)"""
    value = os.environ.get("PAGEDLLM_PDL", "1").strip().lower() or "1"
    if value not in _PDL_MODES:
        raise ValueError(f"PAGEDLLM_PDL={value!r}: expected one of {', '.join(_PDL_MODES)}")
    return value


def pdl(x: torch.Tensor) -> dict:
    """The launch options and switch of a kernel that keeps the PDL rules (kernels/pdl_triton.py)
    for work on x's device: {"PDL": True, "launch_pdl": True} when PAGEDLLM_PDL is on and the
    device and triton support it, else {"PDL": False} (the launch as before)."""
    if x.is_cuda and _pdl_mode() != "0" and _pdl_supported(x.device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def pdl_weights(x: torch.Tensor, weight: torch.Tensor, block_k: int, tiles: int = 2) -> dict:
    """pdl(x) for a GEMM kernel with a PREFETCH_K switch (pdl_triton.prefetch_rows_l2), which
    PAGEDLLM_PDL=prefetch sets to `tiles` K steps where the weight rows' addresses at every
    K step are 16-byte aligned (the bulk prefetch's requirement)."""
    opts = pdl(x)
    size = weight.element_size()
    if (
        opts["PDL"]
        and _pdl_mode() == "prefetch"
        and weight.data_ptr() % 16 == 0
        and weight.stride(0) * size % 16 == 0
        and block_k * size % 16 == 0
    ):
        opts["PREFETCH_K"] = tiles * block_k
    return opts
