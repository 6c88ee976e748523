"""Batch-1 latency (W2 of docs/benchmarks.md): one request, a 128-token prompt, 256
output tokens, greedy, ignore_eos. Figures: ms per output token of the decode alone,
(E2E - TTFT) / (n - 1), and tokens/s; pagedllm against `transformers` `generate` (default cache)
on the same random weights, in one process run.

TTFT is measured the same way for both: a max_tokens=1 request on a fresh prompt of the same
length, timed on the wall clock; for pagedllm the full run's own RequestOutput.metrics
(first_token_time, last_token_time) give a second decode figure. Each iteration uses fresh random
prompts, so the prefix cache never shortens a prefill. Medians over --iters, after a warm-up
request of the full length.

A config dir holds no tokenizer files (AutoTokenizer then fails for Llama and builds a one-token
vocabulary for Qwen3), so the engine gets a synthetic word-level tokenizer covering the whole
vocabulary (common.synthetic_tokenizer) and detokenizes at a realistic cost;
--skip-tokenizer-init runs it with none.

    python benchmarks/latency.py                                   # Llama-3.1-8B bf16, on the GPU
    python benchmarks/latency.py --model benchmarks/configs/tiny-llama --dtype float32   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(HERE, "configs", "llama-3.1-8b"),
                   help="a config dir; its weights are random (load_format=dummy)")
    p.add_argument("--tokenizer", default=None,
                   help="default: the model dir's own, else a synthetic word-level tokenizer")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="run the engine without a tokenizer (no output text, no detokenizing cost)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=None, help="default: input + output + 16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", choices=("hf", "none"), default="hf")
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 1GiB; default: the engine decides")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, help="fp8: FP8 weights (quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs for pagedllm (the peer uses one)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.input_len < 1 or args.output_len < 2 or args.iters < 1:
        p.error("need --input-len >= 1, --output-len >= 2, --iters >= 1")
    return args


def summarize(name: str, ttft: list[float], e2e: list[float], n: int, note: str = "") -> dict:
    decode_ms = [1000 * (e - t) / (n - 1) for t, e in zip(ttft, e2e)]
    ms = statistics.median(decode_ms)
    return {
        "engine": name,
        "output_tokens": n,
        "ttft_ms": 1000 * statistics.median(ttft),
        "e2e_s": statistics.median(e2e),
        "decode_ms_per_token": ms,
        "decode_tok_per_s": 1000 / ms,
        "e2e_tok_per_s": n / statistics.median(e2e),
        "decode_ms_all_iters": [round(x, 3) for x in decode_ms],
        "note": note,
    }


def run_ours(args, tokenizer: str | None, prompts) -> list[dict]:
    from pagedllm import LLM, SamplingParams

    extra = {"skip_tokenizer_init": True} if args.skip_tokenizer_init else {}
    max_model_len = args.max_model_len or args.input_len + args.output_len + 16
    llm = LLM(args.model, tokenizer=tokenizer, load_format="dummy", dtype=args.dtype, seed=args.seed, **extra,
              max_model_len=max_model_len, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype,
              **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}))
    n = args.output_len
    full = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def timed(prompt, params):
        common.sync()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        common.sync()
        return time.perf_counter() - t0, out

    # the warm-up runs the whole length once, so no timed step is the first at its context length
    # (a Triton kernel compiled on first use at a new specialization would land in iteration 1)
    timed(prompts["warmup"], full)
    ttft, e2e, m_ttft, m_e2e = [], [], [], []
    for i in range(args.iters):
        t, _ = timed(prompts["ttft"][i], one)
        e, out = timed(prompts["full"][i], full)
        got = len(out.outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"pagedllm produced {got} tokens, expected {n}")
        ttft.append(t)
        e2e.append(e)
        m = out.metrics
        if m is not None and m.first_token_time is not None and m.last_token_time is not None:
            m_ttft.append(m.first_token_time - m.arrival_time)
            m_e2e.append(m.last_token_time - m.arrival_time)
    rows = [summarize("pagedllm LLM.generate", ttft, e2e, n, "TTFT from a max_tokens=1 run")]
    if m_ttft:
        rows.append(summarize("pagedllm (RequestOutput.metrics)", m_ttft, m_e2e, n,
                              "TTFT and E2E from the same run's metrics"))
    return rows  # the engine goes with this frame; main() releases its memory


@torch.inference_mode()
def run_peer(args, prompts) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = common.hf_model_from_config(args.model, dtype, device, args.seed)
    n = args.output_len

    def timed(prompt, max_new):
        gen = common.hf_generation_config(model, 0.0, max_new)
        ids = torch.tensor([prompt], device=device)
        common.sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        common.sync()
        if out.shape[1] - ids.shape[1] != max_new:
            raise RuntimeError(f"transformers produced {out.shape[1] - ids.shape[1]} tokens, expected {max_new}")
        return time.perf_counter() - t0

    timed(prompts["warmup"], 8)
    ttft, e2e = [], []
    for i in range(args.iters):
        ttft.append(timed(prompts["ttft"][i], 1))
        e2e.append(timed(prompts["full"][i], n))
    row = summarize("hf generate (default cache)", ttft, e2e, n,
                    f"attn={getattr(model.config, '_attn_implementation', '?')}; TTFT from a max_new_tokens=1 run")
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model)
    vocab = min(cfg.vocab_size, 10000)
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(vocab) for _ in range(args.input_len)]

    prompts = {"warmup": prompt(), "ttft": [prompt() for _ in range(args.iters)],
               "full": [prompt() for _ in range(args.iters)]}
    tmp = tempfile.TemporaryDirectory(prefix="pagedllm-bench-")
    tokenizer = args.tokenizer
    if tokenizer is None and not args.skip_tokenizer_init and not common.has_tokenizer_files(args.model):
        tokenizer = common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg),
                                               os.path.join(tmp.name, "tokenizer"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"W2 latency: {os.path.basename(args.model.rstrip('/'))} random weights ({args.dtype}); one request, "
          f"{args.input_len}-token prompt, {args.output_len} output tokens, greedy, ignore_eos; "
          f"median of {args.iters}; {threads} torch threads on {device}", flush=True)

    rows = run_ours(args, tokenizer, prompts)
    common.release_memory()
    print(f"pagedllm: {rows[0]['decode_ms_per_token']:.2f} ms/token (iterations: {rows[0]['decode_ms_all_iters']})",
          flush=True)
    if args.peer == "hf":
        rows.append(run_peer(args, prompts))

    ours = rows[0]
    print()
    head = (f"{'engine':<34} {'TTFT ms':>9} {'E2E s':>8} {'decode ms/tok':>14} {'decode tok/s':>13} "
            f"{'E2E tok/s':>10} {'peer/ours ms':>13}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = "" if r is ours or r["engine"].startswith("pagedllm") else \
            f"{r['decode_ms_per_token'] / ours['decode_ms_per_token']:.2f}x"
        print(f"{r['engine']:<34} {r['ttft_ms']:>9.1f} {r['e2e_s']:>8.3f} {r['decode_ms_per_token']:>14.2f} "
              f"{r['decode_tok_per_s']:>13.1f} {r['e2e_tok_per_s']:>10.1f} {ratio:>13}")
    machine = common.machine_info()
    common.print_machine_line(machine)
    common.write_json(args.output_json, {
        "workload": "w2",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": vars(args),
        "machine": machine,
        "rows": rows,
    })
    tmp.cleanup()


if __name__ == "__main__":
    main()
