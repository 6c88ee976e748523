"""Structured-output overhead: the same requests unconstrained and held to a JSON schema, side
by side in one process (one engine, alternating runs: U C C U ...). Figure: output tokens per
second of each; the ratio constrained / unconstrained is the overhead (issue #12 asks >= 0.9).

Every request sets ignore_eos and its own max_tokens, so both runs produce the same number of
tokens; once a constrained output's JSON is complete its mask allows every token, so the run
also reports how many tokens were produced while a grammar was live.

    python benchmarks/structured_bench.py --workload cpu                   # SmolLM2, W4's prompts
    python benchmarks/structured_bench.py --workload gpu --tokenizer DIR   # Qwen3-0.6B dummy, W1's shape

The GPU workload is Qwen3-0.6B's architecture with random weights (W1: 256 prompts of [100,
1024] random ids, max_tokens in [100, 1024], temperature 0.6) and SmolLM2's tokenizer (a real
one, so the grammar has JSON's characters to choose from); the vocabulary is cut to that
tokenizer's 49,152 ids and its EOS id is the tokenizer's (`hf_overrides`), the only changes to the model.

After each constrained run it prints what the grammar work cost per step (structured_output/
matcher.py's GRAMMAR_TIMES): rows, the wait for the previous step's tokens, accepting them,
filling the masks (on the grammar thread on CUDA) and the engine thread's wait for it (join).
PAGEDLLM_GRAMMAR_THREAD=0 runs the grammar work inline, PAGEDLLM_GRAMMAR_THREADS=N sets the
fill's threads, PAGEDLLM_GRAMMAR_PROCS=N the grammar worker processes (0: matchers in the engine).
An output that completed its JSON early is then held to the grammar's end
(only the stop tokens) for one token, which ignore_eos keeps: so the constrained outputs hold
more stop tokens than the unconstrained ones (counted as `stop tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from throughput import W4_QUESTIONS, chat_ids  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "tags", "summary"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--tokenizer", default=None, help="gpu: a tokenizer directory (SmolLM2's saved)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2, help="U C C U per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    return p.parse_args()


def build(args):
    from pagedllm import LLM, SamplingParams
    from pagedllm.config import default_model_path

    rng = random.Random(args.seed)
    if args.workload == "cpu":
        common.set_threads()
        llm = LLM(default_model_path(), max_model_len=1024)
        tok = llm.get_tokenizer()
        n = args.num_prompts or len(W4_QUESTIONS)
        prompts = [chat_ids(tok, q + " Answer as JSON.") for q in W4_QUESTIONS[:n]]
        max_tokens = [rng.randint(16, 128) for _ in prompts]
        temperature = 0.0
    else:
        from transformers import AutoTokenizer

        # the tokenizer's EOS, not Qwen3's (151645 is past the cut vocabulary: a grammar that
        # ended would allow no token)
        eos = AutoTokenizer.from_pretrained(args.tokenizer).eos_token_id
        llm = LLM(os.path.join(HERE, "configs", "qwen3-0.6b"), tokenizer=args.tokenizer, load_format="dummy",
                  dtype="bfloat16", hf_overrides={"vocab_size": 49152, "eos_token_id": eos}, max_model_len=4096)
        n = args.num_prompts or 256
        prompts = [[rng.randint(0, 9999) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
        max_tokens = [rng.randint(100, 1024) for _ in range(n)]
        temperature = 0.6

    from pagedllm.structured_output import StructuredOutputsParams

    def params(constrained: bool):
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        return [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=None,
                               structured_outputs=so) for m in max_tokens]

    return llm, prompts, params


def live_tokens(tok, texts: list[str]) -> int:
    """Tokens of each output up to the end of its JSON value (where its grammar ended)."""
    dec = json.JSONDecoder()
    total = 0
    for t in texts:
        s = t.lstrip()
        try:
            _, end = dec.raw_decode(s)
        except ValueError:
            end = len(s)  # never completed: live throughout
        total += len(tok.encode(s[:end], add_special_tokens=False))
    return total


def main() -> None:
    args = parse_args()
    machine = common.machine_info()
    common.print_machine_line(machine)
    llm, prompts, params = build(args)
    tok = llm.get_tokenizer()
    # warm-up: both kinds, a few requests (compiles the grammar, captures what needs capturing)
    for constrained in (False, True):
        llm.generate(prompts[:4], params(constrained)[:4], use_tqdm=False)
    runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    # tokens per second of this process's CPU time: on a shared CPU machine steadier than the
    # wall clock (other processes' load stretches the wall time, less so the CPU time spent)
    cpu_runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    tokens: dict[str, int] = {}
    live = 0
    order = []
    for _ in range(args.rounds):
        order += [False, True, True, False]
    from pagedllm.structured_output.matcher import GRAMMAR_TIMES

    stop_ids = set(llm.llm_engine.eos_token_ids)
    if tok.eos_token_id is not None:
        stop_ids.add(tok.eos_token_id)
    grammar: dict[str, float] = {}
    for constrained in order:
        name = "json_schema" if constrained else "unconstrained"
        before = dict(GRAMMAR_TIMES)
        common.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params(constrained), use_tqdm=False)
        common.sync()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        stops = sum(t in stop_ids for o in outs for c in o.outputs for t in c.token_ids)
        tokens[name] = n
        runs[name].append(n / dt)
        cpu_runs[name].append(n / cpu)
        print(f"{name:14s} {n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s; stop tokens {stops}", flush=True)
        steps = GRAMMAR_TIMES["steps"] - before["steps"]
        if steps:
            grammar = {k: (GRAMMAR_TIMES[k] - before[k]) / steps * (1 if k == "rows" else 1e3)
                       for k in ("rows", "wait_prev", "accept", "fill", "worker_fill", "join")}
            print(f"  grammar steps {steps}: per step {grammar['rows']:.0f} rows, "
                  f"wait prev {grammar['wait_prev']:.2f} ms, "
                  f"accept {grammar['accept']:.2f} ms, fill {grammar['fill']:.2f} ms (in the slowest worker "
                  f"process {grammar['worker_fill']:.2f} ms), engine thread's join "
                  f"{grammar['join']:.2f} ms", flush=True)
        if constrained:
            texts = [o.outputs[0].text for o in outs]
            live = live_tokens(tok, texts)
            valid = 0
            for t in texts:
                try:
                    json.JSONDecoder().raw_decode(t.lstrip())
                    valid += 1
                except ValueError:
                    pass
    med = {k: statistics.median(v) for k, v in runs.items()}
    # each U C (or C U) pair ran back to back: the median of the pairs' ratios
    pairs = [c / u for u, c in zip(runs["unconstrained"], runs["json_schema"])]
    ratio = med["json_schema"] / med["unconstrained"]
    print(f"\nworkload {args.workload}: {len(prompts)} requests, {tokens['json_schema']} output tokens per run "
          f"({live} under a live grammar; {valid}/{len(prompts)} outputs begin with a complete JSON value)")
    print(f"| run | tok/s (median of {len(runs['unconstrained'])}) | all runs |")
    print("|---|---|---|")
    for k, v in runs.items():
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    cpu_med = {k: statistics.median(v) for k, v in cpu_runs.items()}
    cpu_ratio = cpu_med["json_schema"] / cpu_med["unconstrained"]
    print(f"| tok per CPU second | {cpu_med['unconstrained']:.1f} / {cpu_med['json_schema']:.1f} | "
          f"{', '.join(f'{x:.1f}' for x in cpu_runs['unconstrained'])} / "
          f"{', '.join(f'{x:.1f}' for x in cpu_runs['json_schema'])} |")
    print(f"ratio json_schema / unconstrained: {ratio:.3f} (medians); pairs run back to back: "
          f"{', '.join(f'{r:.3f}' for r in pairs)} (median {statistics.median(pairs):.3f}); "
          f"per CPU second: {cpu_ratio:.3f}")
    common.write_json(args.output_json, {"machine": machine, "revision": common.source_revision(), "runs": runs,
                                         "median": med, "ratio": ratio, "pair_ratios": pairs,
                                         "cpu_runs": cpu_runs, "cpu_ratio": cpu_ratio, "tokens": tokens,
                                         "live_tokens": live,
                                         "grammar_ms_per_step": grammar,
                                         "env": {k: v for k, v in os.environ.items()
                                                 if k.startswith("PAGEDLLM_GRAMMAR")}})


if __name__ == "__main__":
    main()
