"""Host time of the engine's output processing per step at N running requests: LLMEngine._process
of an all-decode step (the scheduler's update_from_output: append, token stops; then the
OutputProcessor: detokenize, stop strings, logprob dicts, the RequestOutputs), timed in place on
each step and split into its two parts, median over the steps. The requests' outputs are of
the kind --kind asks (final: what LLM.generate and a non-streamed server request ask; delta:
a streamed server request; cumulative: the default of LLMEngine.add_request, which
profile_gpu.py uses). Runs on any tree, on the CPU with a tiny model and a word-level
tokenizer of the model's whole vocabulary (as profile_gpu.py uses):

    PYTHONPATH=. python benchmarks/output_host_bench.py MODEL_DIR [N] [--kind final|delta|cumulative]
        [--stop] [--logprobs] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("n", type=int, nargs="?", default=256)
    p.add_argument("--kind", choices=("final", "delta", "cumulative"), default="final")
    p.add_argument("--stop", action="store_true", help="two stop strings per request (never matched)")
    p.add_argument("--logprobs", action="store_true", help="logprobs=2 per request")
    p.add_argument("--steps", type=int, default=100, help="all-decode steps timed")
    args = p.parse_args()

    from transformers import AutoConfig

    from pagedllm import SamplingParams
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import RequestOutputKind

    cfg = AutoConfig.from_pretrained(args.model)
    tok = common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg), tempfile.mkdtemp())
    n = args.n
    eng = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, tokenizer=tok, load_format="dummy", dtype="float32", kv_cache_memory="512MiB",
        max_model_len=2048, max_num_seqs=n, max_num_batched_tokens=max(4096, n), seed=0))
    kind = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
            "cumulative": RequestOutputKind.CUMULATIVE}[args.kind]
    extra: dict = {}
    if args.stop:
        extra["stop"] = ["<t1><t1><t1>", "never"]
    if args.logprobs:
        extra["logprobs"] = 2
    rng = random.Random(0)
    for i in range(n):
        eng.add_request(str(i), [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(50, 500))],
                        SamplingParams(temperature=0.6, max_tokens=args.steps + 200, ignore_eos=True,
                                       output_kind=kind, **extra))
    sched, proc = eng.scheduler, eng.output_processor
    times: dict[str, list[float]] = {"update": [], "outputs": []}
    real_update, real_process = sched.update_from_output, proc.process
    armed = [False]

    def update(so, runner_out):
        armed[0] = so.num_decodes == n and so.total_num_scheduled_tokens == n
        t0 = time.perf_counter()
        res = real_update(so, runner_out)
        if armed[0]:
            times["update"].append(time.perf_counter() - t0)
        return res

    def process(*a):
        t0 = time.perf_counter()
        res = real_process(*a)
        if armed[0]:
            times["outputs"].append(time.perf_counter() - t0)
        return res

    sched.update_from_output, proc.process = update, process
    num_out = 0
    for _ in range(args.steps * 3):
        num_out += len(eng.step())
        if len(times["outputs"]) >= args.steps:
            break
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    what = args.kind + (" + stop strings" if args.stop else "") + (" + logprobs" if args.logprobs else "")
    print(f"{n} decodes, {what}: process {med['update'] + med['outputs']:.3f} ms = update_from_output "
          f"{med['update']:.3f} + output processor {med['outputs']:.3f} ms (medians of {len(times['outputs'])} "
          f"steps; {num_out} outputs)")


if __name__ == "__main__":
    main()
