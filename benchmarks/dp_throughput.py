"""Data parallelism on the CPU: DP=2 (two engine replicas, a process each) against DP=1 (one
engine in this process) on the same W4-style work, alternated in one process run: the
embedded SmolLM2-135M-Instruct in float32, 32 chat prompts, max_tokens uniform in [16, 128],
greedy, ignore_eos, prefix caching off (so no round finds an earlier one's prompts cached).

On a 2-core machine the replicas share the cores that one engine already uses (one torch
thread each instead of two), so the figure is DP's overhead, not a speed-up. Both engines
stay loaded; each round runs both, the order flipped every round; tokens must be equal.

    python benchmarks/dp_throughput.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from throughput import W4_QUESTIONS, chat_ids  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import random

    from pagedllm import LLM, SamplingParams
    from pagedllm.config import default_model_path

    common.print_machine_line(common.machine_info())
    kw = dict(max_model_len=512, enable_prefix_caching=False, kv_cache_memory="256MiB")
    model = default_model_path()
    dp1 = LLM(model, **kw)
    dp2 = LLM(model, data_parallel_size=2, **kw)
    tok = dp1.get_tokenizer()
    rng = random.Random(args.seed)
    prompts = [chat_ids(tok, q) for q in W4_QUESTIONS[: args.num_prompts]]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 128), ignore_eos=True) for _ in prompts]
    total = sum(sp.max_tokens for sp in params)
    for llm in (dp1, dp2):  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    rates: dict[str, list[float]] = {"dp1": [], "dp2": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        order = [("dp1", dp1), ("dp2", dp2)] if r % 2 == 0 else [("dp2", dp2), ("dp1", dp1)]
        for name, llm in order:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            rates[name].append(total / dt)
            print(f"round {r + 1} {name}: {total} tokens in {dt:.2f} s = {total / dt:.1f} tok/s", flush=True)
    same = tokens["dp1"] == tokens["dp2"]
    st = dp2.llm_engine.get_stats()
    print(f"identical greedy tokens: {same}; DP=2 generation tokens per replica: "
          f"{[s.generation_tokens for s in st.replicas]}")
    m1, m2 = statistics.median(rates["dp1"]), statistics.median(rates["dp2"])
    print(f"median DP=1 {m1:.1f} tok/s, DP=2 {m2:.1f} tok/s, DP=2/DP=1 = {m2 / m1:.2f}x "
          f"(rounds: {[round(x, 1) for x in rates['dp1']]} / {[round(x, 1) for x in rates['dp2']]})")
    dp2.llm_engine.shutdown()


if __name__ == "__main__":
    main()
