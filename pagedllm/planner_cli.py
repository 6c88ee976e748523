"""The `pagedllm plan` command: its arguments, its report (planner.py builds the plan)."""

from __future__ import annotations

from typing import Any

from pagedllm.planner import (
    GPUS,
    QUANTIZATIONS,
    MemoryPlan,
    PlanInputs,
    _GiB,
    alternatives,
    build_plan,
    smallest_fix,
)


def _gib(n: float) -> str:
    return f"{n / _GiB:.2f} GiB"


def format_plan(plan: MemoryPlan, alts: list[tuple[str, MemoryPlan]] | None = None) -> str:
    inp = plan.inputs
    where = (f"GPU of {_gib(inp.gpu_memory)} x {inp.gpu_memory_utilization}" if inp.device == "cuda" else "CPU")
    rows = [
        ("model", f"{inp.model} ({plan.architecture}, {plan.num_layers} layers, {plan.total_params / 1e9:.3f}B "
                  f"parameters per rank"
                  + (f"; MoE: {plan.moe_params[0] / 1e9:.2f}B in all, {plan.moe_params[1] / 1e9:.2f}B active per "
                     f"token" + (", experts placed whole (expert parallel)" if inp.enable_expert_parallel else "")
                     if plan.moe_params else "") + ")"),
        ("precision", f"weights {plan.dtype}" + (f" ({inp.quantization} linears)" if inp.quantization not in ("auto", "none") else "")
                      + f", KV cache {plan.kv_dtype}"),
        ("layout", f"TP={inp.tensor_parallel_size} x PP={inp.pipeline_parallel_size} "
                   f"(layers per stage {plan.stage_layers}), {where}"),
        ("weights per rank", _gib(plan.weight_bytes_per_rank)),
        *[(k.replace("_bytes", "").replace("_", " "), _gib(v)) for k, v in plan.extra.items()],
        ("activations", _gib(plan.activation_bytes)),
        ("KV per token", f"{plan.kv_bytes_per_token} bytes"),
        ("KV cache", f"{_gib(plan.kv_cache_bytes)} = {plan.num_blocks} blocks x {inp.block_size} tokens "
                     f"= {plan.tokens} tokens"),
        ("max concurrency", f"{plan.max_concurrency:.2f}x at max_model_len={plan.max_model_len}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if not plan.fits:
        fix = smallest_fix(plan)
        lines.append(f"DOES NOT FIT: the cache holds {plan.tokens} tokens, fewer than max_model_len="
                     f"{plan.max_model_len}; " + (f"smallest change that fits: {fix}" if fix else "no single change fits"))
    if alts:
        lines.append("")
        lines.append(f"{'what if':<28} {'weights/rank':>13} {'KV tokens':>11} {'concurrency':>12}")
        for label, alt in alts:
            lines.append(f"{label:<28} {_gib(alt.weight_bytes_per_rank):>13} {alt.tokens:>11} "
                         f"{alt.max_concurrency:>11.2f}x")
    return "\n".join(lines)


def add_plan_args(parser: Any) -> None:
    parser.add_argument("model", metavar="MODEL", help="A Hugging Face directory or .gguf file (only its config is read).")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="Plan for a GPU or for this CPU.")
    parser.add_argument("--gpu", default="H200", choices=sorted(GPUS), help="GPU model (its memory).")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="GPU memory in GiB (overrides --gpu).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="Share of GPU memory the engine uses.")
    parser.add_argument("--kv-cache-memory", default=None, help="KV cache size (e.g. 4GiB), instead of the derived one.")
    parser.add_argument("--dtype", default="auto", help="Weight dtype: auto, float32, float16, bfloat16.")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="Weight storage of the linears (auto: gguf blocks for a .gguf file on the CPU, else none).")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"), help="KV cache dtype.")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE: whole experts per tensor-parallel rank instead of a slice of each.")
    parser.add_argument("--max-model-len", "--max-seq-length", dest="max_model_len", type=int, default=None)
    parser.add_argument("--block-size", "--cache-block-size", dest="block_size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="Token budget of a step (the activation estimate). Default: 8192 on GPU.")
    parser.add_argument("--json", action="store_true", help="Print the plan (and the what-ifs) as JSON.")


def run_plan(ns: Any) -> int:
    import json
    import sys

    from pagedllm.engine.vllm_compat import parse_size

    try:
        memory = int(ns.gpu_memory_gib * _GiB) if ns.gpu_memory_gib else GPUS[ns.gpu]
        inp = PlanInputs(
            model=ns.model, dtype=ns.dtype, quantization=ns.quantization, kv_cache_dtype=ns.kv_cache_dtype,
            tensor_parallel_size=ns.tensor_parallel_size, pipeline_parallel_size=ns.pipeline_parallel_size,
            max_model_len=ns.max_model_len, block_size=ns.block_size, max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens, device=ns.device, gpu_memory=memory,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            enable_expert_parallel=ns.enable_expert_parallel,
            kv_cache_memory=None if ns.kv_cache_memory is None else parse_size(ns.kv_cache_memory, "kv_cache_memory"),
        )
        plan = build_plan(inp)
        alts = alternatives(plan)
    except ValueError as e:
        print(f"pagedllm plan: error: {e}", file=sys.stderr)
        return 2
    if ns.json:
        doc = plan.to_dict()
        doc["smallest_fix"] = smallest_fix(plan)
        doc["what_if"] = {label: alt.to_dict() for label, alt in alts}
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(plan, alts))
    return 0 if plan.fits else 1
