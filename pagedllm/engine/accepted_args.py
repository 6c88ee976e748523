"""The vLLM engine arguments that have no meaning in pagedllm. Each is accepted (so a vLLM script
or command line runs unchanged) and, when set to anything but its default, logged once in a line
that says what pagedllm does instead. `EngineArgs` inherits these fields; their flags are
generated like every other field's (entrypoints/engine_cli.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.engine.arg_utils import accepted


@dataclass
class AcceptedArgs:
    trust_remote_code: bool = accepted(
        False,
        "Run code from the model repository.",
        "pagedllm builds the model from its own code for the architectures it "
        "supports; no code from the repository runs.",
    )
    code_revision: str | None = accepted(
        None, "Revision of the repository's model code.", "no code from the repository runs."
    )
    tokenizer_mode: str = accepted(
        "auto",
        "vLLM's tokenizer implementation.",
        "the tokenizer is transformers' AutoTokenizer (the fast one when there is one).",
    )
    model_impl: str = accepted("auto", "vLLM's model implementation.", "pagedllm's own model code always runs.")
    config_format: str = accepted("auto", "Format of the model config.", "config.json (or the GGUF header) is read.")
    max_num_partial_prefills: int = accepted(
        1,
        "Prompts vLLM may prefill concurrently.",
        "chunks of waiting prompts fill each step's token budget in order.",
        parse="positive_int",
    )
    max_long_partial_prefills: int = accepted(
        1,
        "Long prompts vLLM may prefill concurrently.",
        "chunks of waiting prompts fill each step's token budget in order.",
        parse="positive_int",
    )
    long_prefill_token_threshold: int = accepted(
        0, "Tokens from which vLLM calls a prompt long.", "no prompt is treated as long.", parse="non_negative_int"
    )
    num_scheduler_steps: int = accepted(
        1,
        "vLLM v0's multi-step scheduling.",
        "one step per schedule; --async-scheduling overlaps them.",
        parse="positive_int",
    )
    scheduler_delay_factor: float = accepted(
        0.0, "vLLM v0's scheduling delay.", "use --batch-wait-timeout (milliseconds).", parse="non_negative_float"
    )
    cpu_offload_gb: float = accepted(
        0.0, "GiB of weights vLLM keeps in CPU memory.", "all weights stay on the device.", parse="non_negative_float"
    )
    prefix_caching_hash_algo: str = accepted(
        "builtin",
        "Hash of prefix-cache blocks.",
        "blocks are keyed by a chained hash that is checked against their token ids.",
    )
    disable_custom_all_reduce: bool = accepted(
        False, "vLLM's custom all-reduce kernel.", "all-reduce is NCCL's (gloo's on a CPU)."
    )
    max_parallel_loading_workers: int | None = accepted(
        None, "Workers loading weights in parallel.", "each rank reads its own shard.", parse="positive_int"
    )
    max_seq_len_to_capture: int = accepted(
        8192,
        "Longest sequence run in a CUDA graph.",
        "decode graphs serve every length up to max_model_len.",
        parse="positive_int",
    )
    compilation_config: dict[str, Any] | None = accepted(
        None,
        "torch.compile settings (JSON).",
        "nothing is compiled with torch.compile; decode steps run as CUDA graphs.",
        parse="json",
    )
    disable_sliding_window: bool = accepted(
        False, "Turn off sliding-window attention.", "the supported models attend over the whole context."
    )
    enable_sleep_mode: bool = accepted(False, "vLLM's sleep mode.", "the engine keeps its memory while idle.")
    disable_log_requests: bool = accepted(
        False,
        "Do not log each request.",
        "requests are not logged (the access log lists each HTTP request; --disable-uvicorn-access-log turns it off).",
        group="server",
    )
    enable_log_requests: bool = accepted(
        False, "Log each request.", "requests are not logged; the access log lists each HTTP request.", group="server"
    )
