"""From `EngineArgs` to the frozen `EngineConfig` (config.py): every field checked (a `ValueError`
naming it and its allowed range), then resolved against the checkpoint's config and the machine:
device, dtype, executor backend, tensor/pipeline/data parallel layout, cache and scheduler sizes."""

from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm.config import (
    _DTYPE_ALIASES,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_model_path,
)
from pagedllm.engine.arg_utils import log_accepted
from pagedllm.engine.vllm_compat import (
    log_inapplicable,
    parse_gib_or_size,
    parse_size,
    resolve_attention_backend,
    resolve_block_size,
)

logger = logging.getLogger("pagedllm.config")


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


def _resolve_executor_backend(backend: str | None, tp: int, pp: int = 1, dp: int = 1) -> str:
    if backend is None:
        return "uni" if tp * pp * dp == 1 else "mp"
    _check_choice("distributed_executor_backend", backend, DISTRIBUTED_EXECUTOR_BACKENDS)
    if backend == "uni" and tp * pp * dp > 1:
        raise ValueError(
            f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size={tp} x "
            f"pipeline_parallel_size={pp} x data_parallel_size={dp} needs 'mp' or 'ray'"
        )
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend='ray' needs the ray package: pip install 'pagedllm[ray]'"
            )
    return backend


def _check_tensor_parallel(num_gpus: int, hf_config: Any, device: str, backend: str, tp: int,
                           expert_parallel: bool = False) -> None:
    """The model's heads and MLP must split evenly over tp ranks; with mp on CUDA, one GPU per
    rank (num_gpus ranks in all)."""
    from pagedllm.distributed import check_tp_divides
    from pagedllm.model.layers.fused_moe import check_moe_parallel

    check_moe_parallel(hf_config, tp, expert_parallel)

    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    check_tp_divides(tp, heads, kv_heads)
    inter = getattr(hf_config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's intermediate_size={inter}")
    if device == "cuda" and backend == "mp":
        import torch

        n = torch.cuda.device_count()
        if num_gpus > n:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {num_gpus} "
                             f"needs {num_gpus} GPUs; this machine has {n}")


def build_engine_config(args: EngineArgs) -> EngineConfig:
    from pagedllm.model.loader import load_hf_config  # transformers is heavy; import on demand

    tp = _check_int("tensor_parallel_size", args.tensor_parallel_size, 1)
    pp = _check_int("pipeline_parallel_size", args.pipeline_parallel_size, 1)
    dp = _check_int("data_parallel_size", args.data_parallel_size, 1)
    executor_backend = _resolve_executor_backend(args.distributed_executor_backend, tp, pp, dp)
    _check_int("block_size", args.block_size, 1)
    util = args.gpu_memory_utilization
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    kv_arg = args.kv_cache_memory
    if args.kv_cache_memory_bytes is not None:
        if kv_arg is not None and parse_size(kv_arg, "kv_cache_memory") != parse_size(
                args.kv_cache_memory_bytes, "kv_cache_memory_bytes"):
            raise ValueError("kv_cache_memory and kv_cache_memory_bytes are one setting; give one of them")
        kv_arg = args.kv_cache_memory_bytes
    kv_mem = None if kv_arg is None else parse_size(kv_arg, "kv_cache_memory")
    if kv_mem is not None and kv_mem <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {args.kv_cache_memory!r}")
    swap_gib = parse_gib_or_size(args.swap_space, "swap_space")
    if args.enable_chunked_prefill is False:
        raise ValueError("enable_chunked_prefill=False: pagedllm always splits long prompts over steps "
                         "(chunked prefill); leave enable_chunked_prefill unset or True")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(str(args.generation_config)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {args.generation_config!r}")
    for name in ("hf_overrides", "override_generation_config"):
        if not isinstance(getattr(args, name) or {}, dict):
            raise ValueError(f"{name} must be a dict, got {getattr(args, name)!r}")
    max_num_seqs = _check_int("max_num_seqs", args.max_num_seqs, 1)
    _check_choice("load_format", args.load_format, LOAD_FORMATS)
    _check_choice("preemption_mode", args.preemption_mode, PREEMPTION_MODES)
    _check_choice("scheduling_policy", args.scheduling_policy, SCHEDULING_POLICIES)
    bwt = args.batch_wait_timeout
    if isinstance(bwt, bool) or not isinstance(bwt, (int, float)) or bwt < 0:
        raise ValueError(f"batch_wait_timeout must be a number of milliseconds >= 0, got {bwt!r}")
    seed = _check_int("seed", 0 if args.seed is None else args.seed, 0)
    device = _resolve_device(args.device)

    model = args.model if args.model is not None else default_model_path()
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a path or a hub id, got {model!r}")
    from pagedllm.model.hub import resolve_model, resolve_tokenizer

    hub = dict(download_dir=args.download_dir, token=args.hf_token)
    resolved = resolve_model(model, revision=args.revision, gguf_file=args.gguf_file, **hub)
    model = resolved.path
    hf_config, gguf_file, load_format = load_hf_config(model, args.load_format)
    for key, value in (args.hf_overrides or {}).items():
        setattr(hf_config, key, value)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"model: config of {model!r} names no architectures")
    from pagedllm.model.registry import resolve_architecture

    architecture = resolve_architecture(archs)
    from pagedllm.model.layers.quantization import get_quantization_config

    dtype = _resolve_dtype(args.dtype, hf_config, device)
    quant_config = get_quantization_config(args.quantization, hf_config, load_format, model, device, dtype)
    cache_dtype = _check_choice("kv_cache_dtype", args.kv_cache_dtype, KV_CACHE_DTYPES)
    cache_dtype = "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    block_size = resolve_block_size(args.block_size, head_dim, 4 if dtype == "float32" else 2)
    log_inapplicable(args, device, args.preemption_mode, swap_gib)
    log_accepted(args)
    _check_tensor_parallel(tp * pp * dp, hf_config, device, executor_backend, tp, bool(args.enable_expert_parallel))
    from pagedllm.distributed.pipeline import resolve_layer_partition

    pp_partition = resolve_layer_partition(hf_config.num_hidden_layers, pp)

    from pagedllm.model.layers.rotary import rope_max_positions

    derived_len = rope_max_positions(hf_config)  # max_position_embeddings, extended by rope scaling
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

    tokenizer = model
    if args.tokenizer is not None:
        tokenizer = resolve_tokenizer(args.tokenizer, revision=args.tokenizer_revision, **hub)
    elif args.tokenizer_revision is not None and resolved.repo_id is not None:
        tokenizer = resolve_tokenizer(resolved.repo_id, revision=args.tokenizer_revision, **hub)
    served = args.served_model_name
    served = served[0] if isinstance(served, (list, tuple)) and served else served
    name = served or resolved.name
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
        generation_config=args.generation_config,
        override_generation_config=dict(args.override_generation_config or {}),
        quantization=quant_config,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=float(util),
        kv_cache_memory=kv_mem,
        swap_space=swap_gib,
        enable_prefix_caching=bool(args.enable_prefix_caching),
        cache_dtype=cache_dtype,
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
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, distributed_executor_backend=executor_backend, pipeline_parallel_size=pp,
            pp_layer_partition=pp_partition, data_parallel_size=dp,
            data_parallel_prefix_affinity=bool(args.data_parallel_prefix_affinity),
            enable_expert_parallel=bool(args.enable_expert_parallel),
        ),
        device=device,
        enforce_eager=bool(args.enforce_eager),
        disable_log_stats=bool(args.disable_log_stats),
        skip_tokenizer_init=bool(args.skip_tokenizer_init),
        async_scheduling=(device == "cuda") if args.async_scheduling is None else bool(args.async_scheduling),
        attention_backend=resolve_attention_backend(args.attention_backend),
    )
