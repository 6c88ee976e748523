"""`pagedllm plan` against the engine's own start-up plan, on this machine's device: for each
config, the plan (config only) and a real engine (dummy weights) with the same settings, side by
side — weight bytes, activation peak, KV blocks — and the relative difference.

    python benchmarks/plan_check.py benchmarks/configs/llama-3.1-8b benchmarks/configs/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.planner import PlanInputs, build_plan  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    rows = []
    for cfg in args.configs:
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else 0
        plan = build_plan(PlanInputs(model=cfg, device="cuda" if cuda else "cpu", gpu_memory=memory,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     max_model_len=args.max_model_len,
                                     kv_cache_memory=None if cuda else 1 << 30))
        llm = LLM(cfg, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
                  gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
                  **({} if cuda else {"kv_cache_memory": 1 << 30}))
        worker = llm.llm_engine.executor.worker
        rows.append((os.path.basename(cfg.rstrip("/")), plan, worker.weight_bytes, worker.num_gpu_blocks))
        llm.llm_engine.shutdown()
        del llm, worker
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print(f"{'config':<16} {'plan weights':>13} {'engine':>13} {'plan blocks':>12} {'engine':>9} {'blocks diff':>11}")
    for name, plan, weights, blocks in rows:
        diff = (plan.num_blocks - blocks) / blocks
        print(f"{name:<16} {plan.weight_bytes_per_rank / 2**30:>12.3f}G {weights / 2**30:>12.3f}G "
              f"{plan.num_blocks:>12} {blocks:>9} {100 * diff:>10.2f}%")


if __name__ == "__main__":
    main()
