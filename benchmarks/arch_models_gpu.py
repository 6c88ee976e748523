"""Gemma-2-9B and Phi-3-mini-4k (public configs in benchmarks/configs/, dummy bf16 weights) on
one GPU, each beside the transformers peer in the same run: batch-1 decode latency (W2-style:
a 128-token prompt, greedy; ms per output token = (E2E - TTFT) / (n - 1)) and a W1-style
offline throughput (fewer requests than W1 to fit a short device lease: --num-prompts random
prompts of [100, 512] tokens, max_tokens uniform in [64, --max-out], temperature 0.6,
ignore_eos; useful output tokens / wall second; the peer runs static left-padded batches of
all of them). A table last; JSON per model in --out.

    python benchmarks/arch_models_gpu.py --out /tmp/out
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def requests(n: int, max_out: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 512))] for _ in range(n)]
    return prompts, [rng.randint(64, max_out) for _ in range(n)]


def ours(model_dir: str, args) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=max(args.num_prompts, 8), gpu_memory_utilization=0.45)
    rng = random.Random(1)
    p128 = [rng.randrange(10000) for _ in range(128)]
    n = args.latency_tokens
    llm.generate([p128], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([[x + 1 for x in p128]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([[x + 2 for x in p128]], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    e2e = time.perf_counter() - t
    prompts, outs = requests(args.num_prompts, args.max_out)
    llm.generate(prompts[:2], SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate(outs)]
    common.sync()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    common.sync()
    secs = time.perf_counter() - t
    toks = sum(len(r.outputs[0].token_ids) for r in res)
    del llm, res
    gc.collect()
    common.release_memory()
    return {"decode_ms": 1000 * (e2e - ttft) / (n - 1), "ttft_ms": 1000 * ttft, "w1_tok_s": toks / secs,
            "w1_tokens": toks, "w1_s": secs}


def peer(model_dir: str, args) -> dict:
    model = common.hf_model_from_config(model_dir, torch.bfloat16, "cuda", seed=0)
    rng = random.Random(1)
    p128 = torch.tensor([[rng.randrange(10000) for _ in range(128)]], device="cuda")
    n = args.latency_tokens

    def gen(ids, k):
        cfg = common.hf_generation_config(model, 0.0, k)
        common.sync()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        common.sync()
        return time.perf_counter() - t

    gen(p128, 4)
    ttft, e2e = gen(p128 + 1, 1), gen(p128 + 2, n)
    prompts, outs = requests(args.num_prompts, args.max_out)
    r = common.run_hf_static(model, prompts, outs, len(prompts), 0.6)
    del model
    gc.collect()
    common.release_memory()
    return {"decode_ms": 1000 * (e2e - ttft) / (n - 1), "ttft_ms": 1000 * ttft,
            "w1_tok_s": r.useful_tokens / r.seconds, "w1_tokens": r.useful_tokens, "w1_s": r.seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gemma-2-9b,phi-3-mini-4k")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-out", type=int, default=128)
    p.add_argument("--latency-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name in args.models.split(","):
        d = os.path.join(HERE, "configs", name)
        got = {"model": name, "pagedllm": ours(d, args)}
        print(json.dumps(got), flush=True)
        got["transformers"] = peer(d, args)
        print(json.dumps(got), flush=True)
        rows.append(got)
        if args.out:
            with open(os.path.join(args.out, f"models-{name}.json"), "w") as f:
                json.dump(got, f, indent=1)
    print(f"{'model':16s} {'engine':12s} {'decode ms/tok':>13s} {'TTFT ms':>8s} {'W1-style tok/s':>14s}")
    for r in rows:
        for eng in ("pagedllm", "transformers"):
            x = r[eng]
            print(f"{r['model']:16s} {eng:12s} {x['decode_ms']:13.2f} {x['ttft_ms']:8.1f} {x['w1_tok_s']:14.1f}")
        print(f"{'':16s} {'ratio':12s} {r['transformers']['decode_ms'] / r['pagedllm']['decode_ms']:12.1f}x "
              f"{'':8s} {r['pagedllm']['w1_tok_s'] / r['transformers']['w1_tok_s']:13.1f}x")


if __name__ == "__main__":
    main()
