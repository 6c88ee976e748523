"""`pagedllm plan MODEL`: the memory plan before anything is loaded (the command itself: planner_cli.py).

The founding document's formula, made exact: memory = weights + activations + KV cache.

- Weights per rank: the model is built on torch's `meta` device with this rank's tensor-parallel
  shard (the same classes and sharding the engine uses), so the bytes are the engine's own, not
  a parameter-count estimate; quantized linears are counted at their storage width plus scales.
- KV bytes per token: 2 (K, V) x layers of the stage x KV heads of the rank x head_dim x element.
- Activations (GPU): a peak estimate of the profiling step the engine runs at start-up (one
  step of `max_num_batched_tokens` tokens, logits for `max_num_seqs` rows), plus the CUDA context.
- The cache: on a GPU, `gpu_memory_utilization x memory - weights - activations`; on the CPU,
  `kv_cache_memory` or the engine's default (25% of available RAM, at most 4 GiB, split over
  the ranks). Blocks, tokens, and the max concurrency at `max_model_len` follow as the engine
  computes them (`Worker.determine_num_blocks`).

It never reads weights and never touches a GPU; it needs a config (a directory, a .gguf file,
or a hub id whose config.json is in the local cache or downloadable).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

_GiB = 1 << 30
_MiB = 1 << 20

# Memory as torch reports it (`total_memory`), per GPU.
GPUS: dict[str, int] = {
    "H200": 143771 * _MiB,
    "H100": 81559 * _MiB,
    "H100-NVL": 95830 * _MiB,
    "A100-80G": 81920 * _MiB,
    "A100-40G": 40960 * _MiB,
    "L40S": 46068 * _MiB,
    "L4": 23034 * _MiB,
    "A10": 23028 * _MiB,
    "RTX4090": 24564 * _MiB,
}
# Memory a CUDA process holds outside torch's allocator (context, cuBLAS workspaces), as the
# engine's profiling step sees it on an H200 with torch 2.11.
CUDA_CONTEXT_BYTES = 600 * _MiB
CPU_KV_SHARE, CPU_KV_CAP = 0.25, 4 * _GiB  # the engine's CPU default (worker.py)

_ELEM = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1}
QUANTIZATIONS = ("auto", "none", "fp8", "int4", "int8", "gguf")
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class PlanInputs:
    model: str
    dtype: str = "auto"
    quantization: str = "auto"  # auto: gguf for a .gguf file on the CPU in float32 (the engine's rule), else none
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    device: str = "cuda"  # what the plan is for: cuda (a GPU of `gpu_memory`) or cpu
    gpu_memory: int = GPUS["H200"]
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    available_ram: int | None = None  # CPU plans: None reads /proc/meminfo
    enable_expert_parallel: bool = False  # MoE: whole experts per rank instead of a slice of each


@dataclass(slots=True)
class MemoryPlan:
    inputs: PlanInputs
    architecture: str
    dtype: str
    kv_dtype: str
    num_layers: int
    total_params: int
    weight_bytes_per_rank: int  # the largest stage's rank
    kv_bytes_per_token: int  # per rank, the largest stage
    activation_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    max_model_len: int
    stage_layers: list[int] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)  # e.g. the CPU's packed-GEMM copy
    moe_params: tuple[int, int] | None = None  # MoE: (whole model, active per token)

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.inputs.block_size

    @property
    def max_concurrency(self) -> float:
        return self.tokens / self.max_model_len

    @property
    def fits(self) -> bool:
        return self.tokens >= self.max_model_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "inputs": dataclasses.asdict(self.inputs),
            "architecture": self.architecture,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_dtype,
            "num_layers": self.num_layers,
            "stage_layers": self.stage_layers,
            "total_params": self.total_params,
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "activation_bytes": self.activation_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "num_blocks": self.num_blocks,
            "tokens": self.tokens,
            "max_model_len": self.max_model_len,
            "max_concurrency": round(self.max_concurrency, 3),
            "fits": self.fits,
            "extra": self.extra,
            "moe_total_params": self.moe_params[0] if self.moe_params else None,
            "moe_active_params": self.moe_params[1] if self.moe_params else None,
        }


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Contiguous layers per pipeline stage; the remainder goes to the stages before the last
    (the last one also holds the norm and the LM head)."""
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i if pp > 1 else 0] += 1
    return counts


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    from pagedllm.config import _DTYPE_ALIASES
    from pagedllm.config_build import _resolve_dtype as engine_dtype

    if dtype not in _DTYPE_ALIASES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(_DTYPE_ALIASES)}")
    return engine_dtype(_DTYPE_ALIASES[dtype], hf_config, device)


def _meta_model(hf_config: Any, architecture: str, dtype: str, tp: int, expert_parallel: bool = False) -> Any:
    import torch

    from pagedllm.distributed import ParallelState
    from pagedllm.model.loader import _default_dtype, torch_dtype
    from pagedllm.model.registry import get_model_class

    cls = get_model_class(architecture)
    with _default_dtype(torch_dtype(dtype)), torch.device("meta"):
        return cls(hf_config, ParallelState(tp_rank=0, tp_size=tp, enable_expert_parallel=expert_parallel))


def _weight_bytes(model: Any, quantization: str, stage_of_layer: list[int], pp: int) -> tuple[list[int], int]:
    """Bytes per pipeline stage for rank 0 of each stage's tensor-parallel group, and the
    total parameter count of the (unsharded-by-PP) rank."""
    per_stage = [0] * pp
    seen: set[int] = set()
    params = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        nbytes = p.numel() * p.element_size()
        is_projection = p.dim() == 2 and ".layers." in name
        if quantization != "none" and is_projection:
            out_features = p.shape[0]
            if quantization == "fp8":
                nbytes = p.numel() + 4 * out_features  # e4m3 + a float32 scale per output row
            elif quantization == "int8":
                nbytes = p.numel() + 2 * out_features
            elif quantization == "int4":  # group size 128, 16-bit scales and 4-bit zeros
                nbytes = p.numel() // 2 + p.numel() // 128 * (2 + 1)
        m = _LAYER_RE.search(name)
        if m is not None:
            per_stage[stage_of_layer[int(m.group(1))]] += nbytes
        elif "embed" in name or "wte" in name or "wpe" in name:
            per_stage[0] += nbytes
        else:  # final norm, LM head
            per_stage[-1] += nbytes
    return per_stage, params


def _activation_bytes(hf_config: Any, elem: int, n_tok: int, rows: int, tp: int) -> int:
    """Peak transient bytes of the profiling step beyond the weights: the residual stream and
    norms, the fused qkv and MLP projections of one layer (sharded by TP), and the float32
    logits of `rows` rows (plus their sorted copy and softmax)."""
    hidden = hf_config.hidden_size
    inter = getattr(hf_config, "intermediate_size", 4 * hidden) // tp
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    qkv = (heads + 2 * kv) * head_dim // tp
    per_token = (4 * hidden + qkv + 3 * inter) * elem
    logits = rows * hf_config.vocab_size * 4 * 3
    return n_tok * per_token + logits


def load_model_config(model: str) -> tuple[Any, str]:
    """(transformers config, registry architecture) of a directory, a .gguf file or a hub id
    (`org/name` from the local Hugging Face cache, or downloaded when online — config.json only;
    `org/name:FILE.gguf` needs the file, whose header holds the config): no weights are read."""
    import os

    from pagedllm.model.hub import hub_cache_dir, hub_offline, looks_like_repo_id, resolve_model, split_gguf_spec
    from pagedllm.model.loader import load_hf_config
    from pagedllm.model.registry import resolve_architecture

    repo, gguf_file = split_gguf_spec(model, None)
    if not os.path.exists(repo) and gguf_file is None and looks_like_repo_id(repo):
        from huggingface_hub import hf_hub_download

        try:
            path = os.path.dirname(hf_hub_download(repo, "config.json", cache_dir=hub_cache_dir(),
                                                   local_files_only=hub_offline()))
        except Exception as e:  # noqa: BLE001 - huggingface_hub raises several kinds
            where = "offline (HF_HUB_OFFLINE=1)" if hub_offline() else "online"
            raise ValueError(f"model: no config.json for {repo!r} in the Hugging Face cache {hub_cache_dir()} "
                             f"({where}): {type(e).__name__}") from None
    else:
        path = resolve_model(model).path
    hf_config, _, _ = load_hf_config(path, "auto")
    return hf_config, resolve_architecture(getattr(hf_config, "architectures", None) or [])


def _available_ram() -> int:
    from pagedllm.worker.worker import _available_ram as engine_ram

    return engine_ram()


def _resolve_quantization(inp: PlanInputs, dtype: str) -> str:
    is_gguf = inp.model.endswith(".gguf") and os.path.isfile(inp.model)
    if inp.quantization == "auto":
        return "gguf" if is_gguf and inp.device == "cpu" and dtype == "float32" else "none"
    if inp.quantization == "gguf" and not (is_gguf and inp.device == "cpu" and dtype == "float32"):
        raise ValueError("quantization: gguf needs a .gguf file, device cpu and dtype float32")
    return inp.quantization


def build_plan(inp: PlanInputs) -> MemoryPlan:
    hf_config, architecture = load_model_config(inp.model)
    tp, pp = inp.tensor_parallel_size, inp.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
    if inp.quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: {inp.quantization!r} is not one of {QUANTIZATIONS}")
    dtype = _resolve_dtype(inp.dtype, hf_config, inp.device)
    quantization = _resolve_quantization(inp, dtype)
    kv_dtype = dtype if inp.kv_cache_dtype == "auto" else inp.kv_cache_dtype
    if kv_dtype not in _ELEM:
        raise ValueError(f"kv_cache_dtype: {inp.kv_cache_dtype!r} is not auto, fp8 or fp8_e4m3")
    num_layers = hf_config.num_hidden_layers
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers")
    counts = stage_layer_counts(num_layers, pp)
    stage_of_layer = [s for s, c in enumerate(counts) for _ in range(c)]
    model = _meta_model(hf_config, architecture, dtype, tp, inp.enable_expert_parallel)
    per_stage, params = _weight_bytes(model, "none" if quantization == "gguf" else quantization, stage_of_layer, pp)
    if quantization == "gguf":
        from pagedllm.model.layers.quantization.gguf import file_weight_bytes

        per_stage = file_weight_bytes(inp.model, stage_of_layer, pp, tp)
    from pagedllm.model.layers.fused_moe import check_moe_parallel, config_num_experts, param_counts

    moe_params = None
    if config_num_experts(hf_config):  # MoE: the whole model's parameters and those a token uses
        check_moe_parallel(hf_config, tp, inp.enable_expert_parallel)
        from pagedllm.model.registry import get_model_class

        moe_params = param_counts(get_model_class(architecture), hf_config)

    from pagedllm.distributed import kv_heads_per_rank

    heads = hf_config.num_attention_heads
    num_kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_per_layer_token = 2 * kv_heads_per_rank(num_kv, tp) * head_dim * _ELEM[kv_dtype]
    max_model_len = inp.max_model_len or int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    # the binding stage: the one with the least room (most weights, most layers)
    stage = max(range(pp), key=lambda s: (per_stage[s], counts[s]))
    weight_bytes = per_stage[stage]
    kv_per_token = kv_per_layer_token * counts[stage]
    per_block = kv_per_token * inp.block_size
    extra: dict[str, int] = {}
    if inp.device == "cpu":
        activation = 0
        if inp.kv_cache_memory is not None:
            kv_bytes = inp.kv_cache_memory
        else:
            ram = inp.available_ram if inp.available_ram is not None else _available_ram()
            kv_bytes = min(int(ram * CPU_KV_SHARE), CPU_KV_CAP) // (tp * pp)
        if dtype == "float32" and quantization != "gguf":
            extra["cpu_packed_gemm_copy_bytes"] = sum(
                p.numel() * 4 for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n
            ) // pp
    else:
        n_tok = inp.max_num_batched_tokens or 8192
        rows = min(inp.max_num_seqs, n_tok)
        activation = _activation_bytes(hf_config, _ELEM[dtype], n_tok, rows, tp) + CUDA_CONTEXT_BYTES
        if inp.kv_cache_memory is not None:
            kv_bytes = inp.kv_cache_memory
        else:
            kv_bytes = int(inp.gpu_memory * inp.gpu_memory_utilization) - weight_bytes - activation
    num_blocks = max(int(kv_bytes // per_block), 0) if kv_bytes > 0 else 0
    return MemoryPlan(
        inputs=inp, architecture=architecture, dtype=dtype, kv_dtype=kv_dtype, num_layers=num_layers,
        total_params=params, weight_bytes_per_rank=weight_bytes, kv_bytes_per_token=kv_per_token,
        activation_bytes=activation, kv_cache_bytes=num_blocks * per_block, num_blocks=num_blocks,
        max_model_len=max_model_len, stage_layers=counts, extra=extra, moe_params=moe_params,
    )


def alternatives(plan: MemoryPlan) -> list[tuple[str, MemoryPlan]]:
    """What a change would buy: doubled TP, FP8 weights, an FP8 cache, half the context."""
    inp = plan.inputs
    options: list[tuple[str, PlanInputs]] = []
    if inp.kv_cache_dtype == "auto":
        options.append(("kv_cache_dtype=fp8", dataclasses.replace(inp, kv_cache_dtype="fp8")))
    if inp.quantization in ("auto", "none") and inp.device == "cuda":
        options.append(("quantization=fp8", dataclasses.replace(inp, quantization="fp8")))
    if plan.max_model_len >= 2048:
        options.append((f"max_model_len={plan.max_model_len // 2}",
                        dataclasses.replace(inp, max_model_len=plan.max_model_len // 2)))
    if inp.device == "cuda":
        for tp in (2, 4, 8):
            if tp > inp.tensor_parallel_size:
                options.append((f"tensor_parallel_size={tp}", dataclasses.replace(inp, tensor_parallel_size=tp)))
                break
    out = []
    for label, alt in options:
        try:
            out.append((label, build_plan(alt)))
        except ValueError:
            continue  # e.g. heads not divisible by the TP size
    return out


def smallest_fix(plan: MemoryPlan) -> str | None:
    """For a plan that does not fit, the least intrusive change that does (in this order: an
    FP8 cache, FP8 weights, a shorter context, more GPUs)."""
    if plan.fits:
        return None
    inp = plan.inputs
    tries: list[tuple[str, PlanInputs]] = [("--kv-cache-dtype fp8", dataclasses.replace(inp, kv_cache_dtype="fp8"))]
    if inp.device == "cuda":
        tries.append(("--quantization fp8", dataclasses.replace(inp, quantization="fp8")))
    length = plan.max_model_len
    while length > 256:
        length //= 2
        tries.append((f"--max-model-len {length}", dataclasses.replace(inp, max_model_len=length)))
    if inp.device == "cuda":
        tries += [(f"--tensor-parallel-size {tp}", dataclasses.replace(inp, tensor_parallel_size=tp))
                  for tp in (2, 4, 8) if tp > inp.tensor_parallel_size]
    for label, alt in tries:
        try:
            if build_plan(alt).fits:
                return label
        except ValueError:
            continue
    return None
