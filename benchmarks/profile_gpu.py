"""Where a step's time goes on the GPU: runs the engine on a W1- or W2-like load and records a
window of steps with torch.profiler, then prints the kernels by total device time, the device
time per step, the wall time per step and the host phases (engine.step_timing), then the
wall time and host phases of as many steps again without the profiler (which slows the host).

If device busy time per step is well under the wall time per step, the engine is bound by its
host; if they are close, the kernels are what to speed up.

    python3 benchmarks/profile_gpu.py --load w2            # Llama-3.1-8B, batch 1
    python3 benchmarks/profile_gpu.py --load w1            # Qwen3-0.6B, 256 requests
    python3 benchmarks/profile_gpu.py --load w1 --output-kind delta   # as the server's streams
    python3 benchmarks/profile_gpu.py --load w1 --model benchmarks/configs/tiny-llama --dtype float32 \\
        --num-prompts 8 --steps 5                          # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", choices=("w1", "w2"), default="w2")
    p.add_argument("--model", default=None, help="config dir (w1: qwen3-0.6b, w2: llama-3.1-8b)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=None, help="w1: 256, w2: 1")
    p.add_argument("--skip-steps", type=int, default=40, help="steps run before the window (prefill, warm-up)")
    p.add_argument("--steps", type=int, default=30, help="steps in the profiled window")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default=None, help="fp8: FP8 weights (quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    p.add_argument("--trace", default=None, help="write a Chrome trace of the window here (benchmarks/trace_path.py "
                   "reads it: what each kernel adds to a step when kernels overlap)")
    p.add_argument("--max-model-len", type=int, default=None, help="w1: 4096, w2: 2048 (latency.py's W2 takes "
                   "400, moe_bench.py's 4096: the decode graphs' split count follows it)")
    p.add_argument("--output-kind", choices=("final", "delta", "cumulative"), default="final",
                   help="the requests' RequestOutputKind: final (FINAL_ONLY, what LLM.generate and so W1 "
                        "ask for; the default), delta (a streamed server request), cumulative "
                        "(LLMEngine.add_request's default, which this profile used before 2026-12-03)")
    args = p.parse_args(argv)

    from pagedllm import SamplingParams
    from pagedllm.engine.llm_engine import LLMEngine, StepTiming
    from pagedllm.config import EngineArgs
    from pagedllm.sampling_params import RequestOutputKind

    kind = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
            "cumulative": RequestOutputKind.CUMULATIVE}[args.output_kind]

    model = args.model or os.path.join(HERE, "configs", "qwen3-0.6b" if args.load == "w1" else "llama-3.1-8b")
    n = args.num_prompts or (256 if args.load == "w1" else 1)
    tmp = tempfile.mkdtemp()
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    tok = common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg), tmp)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, tokenizer=tok, load_format="dummy", dtype=args.dtype,
        max_model_len=args.max_model_len or (4096 if args.load == "w1" else 2048),
        enforce_eager=args.enforce_eager, seed=0,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype))
    rng = random.Random(0)
    for i in range(n):
        plen = rng.randint(100, 1024) if args.load == "w1" else 128
        prompt = [rng.randrange(10000) for _ in range(plen)]
        sp = (SamplingParams(temperature=0.6, max_tokens=1024, ignore_eos=True, output_kind=kind) if args.load == "w1"
              else SamplingParams(temperature=0.0, max_tokens=args.skip_steps + 2 * args.steps + 16, ignore_eos=True,
                                  output_kind=kind))
        engine.add_request(str(i), prompt, sp)
    for _ in range(args.skip_steps):
        engine.step()
    common.sync()
    engine.step_timing = StepTiming()
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        common.sync()
        wall = time.perf_counter() - t0
    running = len(engine.scheduler.running)
    print(f"{args.load}: {os.path.basename(model)} {args.dtype}, {running} requests running; window of "
          f"{args.steps} steps after {args.skip_steps}; outputs {args.output_kind}")
    print(f"wall per step: {1e3 * wall / args.steps:.3f} ms; {engine.step_timing.summary()}")
    # the profiler records every host op, which slows the host phases above: the same number
    # of steps again without it (w2's request lasts through both windows: before 2026-12-03 it
    # ended 16 steps into this one, and the empty steps after made this figure too small)
    engine.step_timing = StepTiming()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    common.sync()
    wall = time.perf_counter() - t0
    print(f"without the profiler: wall per step: {1e3 * wall / args.steps:.3f} ms; {engine.step_timing.summary()}")
    ev = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    kernels = [e for e in ev if getattr(e, dev_key, 0) > 0]
    busy = sum(getattr(e, dev_key) for e in kernels) / 1e3  # ms
    print(f"device busy per step: {busy / args.steps:.3f} ms (sum of kernel times)")
    if kernels:
        print(f"\n{'kernel':<80} {'calls/step':>10} {'ms/step':>9} {'share':>6}")
        for e in sorted(kernels, key=lambda e: -getattr(e, dev_key))[: args.top]:
            t = getattr(e, dev_key) / 1e3
            print(f"{e.key[:80]:<80} {e.count / args.steps:>10.1f} {t / args.steps:>9.3f} {100 * t / busy:>5.1f}%")
    else:
        print(ev.table(sort_by="self_cpu_time_total", row_limit=args.top))
    # host-side CUDA runtime calls: a synchronizing one (cudaStreamSynchronize, cudaEventSynchronize,
    # a pageable cudaMemcpy, cudaHostAlloc, cudaFree) with a large time is where the host waits
    api = [e for e in ev if e.key.startswith(("cuda", "cu")) and getattr(e, dev_key, 0) == 0]
    if api:
        print(f"\n{'CUDA runtime call (host)':<60} {'calls/step':>10} {'ms/step':>9}")
        for e in sorted(api, key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"{e.key[:60]:<60} {e.count / args.steps:>10.1f} {e.self_cpu_time_total / 1e3 / args.steps:>9.3f}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    engine.shutdown()


if __name__ == "__main__":
    main()
