"""W2 (batch-1 decode, latency.py's measure) with several L2-prefetch budgets in one process:
the model is loaded once, and before each timed request the decode CUDA graphs are captured
again with the budget's WeightPrefetcher (pagedllm/worker/weight_prefetch.py; 0 = none). The
budgets alternate, their order flipped every round, so drift hits them alike; medians per budget.

    python benchmarks/prefetch_bench.py --quantization fp8 --budgets 0 16 24 40 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from latency import HERE  # noqa: E402


def recapture(llm, budget_mb: float) -> None:
    from pagedllm.worker.cuda_graph import DecodeGraphs
    from pagedllm.worker.weight_prefetch import WeightPrefetcher

    worker = llm.llm_engine.executor.worker
    old = worker.runner.graphs
    old.graphs.clear()
    worker.runner.graphs = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    prefetcher = WeightPrefetcher(worker.model, worker.device, int(budget_mb * 1e6)) if budget_mb > 0 else None
    graphs = DecodeGraphs(old.model, old.buffers, old.max_bs, old.max_model_len, old.logits.shape[1], prefetcher)
    graphs.capture()
    worker.runner.graphs = graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(HERE, "configs", "llama-3.1-8b"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--budgets", type=float, nargs="+", default=[0, 24], help="MB asked into L2 per layer")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefetch-block", type=int, default=None,
                   help="bulk requests per program of the prefetch kernel (default: l2_prefetch.BLOCK)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if args.prefetch_block:
        from pagedllm.kernels import l2_prefetch

        l2_prefetch.BLOCK = args.prefetch_block
    from transformers import AutoConfig

    from pagedllm import LLM, SamplingParams

    cfg = AutoConfig.from_pretrained(args.model)
    rng = random.Random(0)
    vocab = min(cfg.vocab_size, 10000)

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(args.input_len)]

    tmp = tempfile.TemporaryDirectory(prefix="pagedllm-bench-")
    tokenizer = common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg), os.path.join(tmp.name, "tok"))
    llm = LLM(args.model, tokenizer=tokenizer, load_format="dummy", dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=8)
    n = args.output_len
    full = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def timed(params) -> float:
        common.sync()
        t0 = time.perf_counter()
        out = llm.generate([prompt()], params, use_tqdm=False)[0]
        common.sync()
        assert len(out.outputs[0].token_ids) == params.max_tokens
        return time.perf_counter() - t0

    ms: dict[float, list[float]] = {b: [] for b in args.budgets}
    for r in range(args.rounds):
        for b in args.budgets if r % 2 == 0 else list(reversed(args.budgets)):
            recapture(llm, b)
            timed(full)  # warm-up at this capture
            ttft, e2e = timed(one), timed(full)
            ms[b].append(1000 * (e2e - ttft) / (n - 1))
            print(f"round {r} budget {b:g} MB: {ms[b][-1]:.3f} ms/token", flush=True)
    base = statistics.median(ms[args.budgets[0]])
    print(f"\nW2 {os.path.basename(args.model.rstrip('/'))} {args.quantization or args.dtype}, batch 1, "
          f"decode ms/token (median of {args.rounds}; budget = MB per layer asked into L2)")
    for b, v in ms.items():
        med = statistics.median(v)
        print(f"  budget {b:>5g} MB: {med:.3f}  {[round(x, 3) for x in v]}  {base / med:.3f}x of budget {args.budgets[0]:g}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "ms_per_token": {str(b): v for b, v in ms.items()},
                       "machine": common.machine_info()}, f, indent=1)
    tmp.cleanup()


if __name__ == "__main__":
    main()
