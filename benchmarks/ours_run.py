"""pagedllm's timed run of a workload (benchmarks/throughput.py, moe_bench.py): one warm-up call,
the timed `LLM.generate` (repeated, the fastest kept), and what it prints: the host phases of a
step, the Triton kernels compiled inside the run, and the step timeline."""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def print_profile(path: str, seconds: float, top: int = 25) -> None:
    import pstats

    print(f"\ncProfile of the timed pagedllm call ({seconds:.2f} s under the profiler; stats in {path}); "
          f"top {top} by own time, then by cumulative time:")
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def _reset_prefix_cache(llm) -> None:
    """So that no timed run finds the prompts of an earlier one (warm-up or repeat) cached."""
    bm = getattr(getattr(llm.llm_engine, "scheduler", None), "block_manager", None)
    if bm is not None and hasattr(bm, "reset_prefix_cache") and not bm.reset_prefix_cache():
        print("(could not reset the prefix cache: blocks still in use)", flush=True)


def best(runs: list, key=lambda r: r.seconds):
    """The fastest of repeated runs: on a shared machine noise only ever adds time."""
    return min(runs, key=key)


def run_ours(llm, prompts, max_tokens, temperature: float, warmup_prompts, profile: str | None = None,
             wait_quiet: float = 0.0, repeat: int = 1) -> tuple[common.Row, list[list[int]]]:
    from pagedllm import SamplingParams
    from pagedllm.kernels._triton import recorded_compiles

    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True) for m in max_tokens]
    # one small warm-up call, excluded: first-call allocations, lazy imports, kernel selection
    llm.generate(warmup_prompts, SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    runs = []
    for i in range(repeat):
        _reset_prefix_cache(llm)
        common.wait_for_quiet(wait_quiet)
        prof = None
        if profile and i == 0:
            import cProfile

            prof = cProfile.Profile()
        from pagedllm.engine.llm_engine import StepTiming

        llm.llm_engine.step_timing = StepTiming()
        llm.llm_engine.step_log = collections.deque(maxlen=1 << 16)  # the whole run's steps
        started = time.time()
        with recorded_compiles() as compiled, common.Stopwatch() as watch:
            if prof is not None:
                prof.enable()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if prof is not None:
                prof.disable()
        if prof is not None:
            prof.dump_stats(profile)
            print_profile(profile, watch.seconds)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        for t, m in zip(tokens, max_tokens):
            if len(t) != m:
                raise RuntimeError(f"pagedllm produced {len(t)} tokens for a request with max_tokens={m}")
        n = sum(len(t) for t in tokens)
        row = common.Row("pagedllm LLM.generate", n, n, watch.seconds, cpu_seconds=watch.cpu_seconds,
                         others_busy=watch.others_busy)
        if repeat > 1:
            print(f"  pagedllm run {i + 1}/{repeat}: {row.seconds:.2f} s, others {_pct(row.others_busy)}", flush=True)
        print(f"  pagedllm {llm.llm_engine.step_timing.summary()}", flush=True)
        if compiled is not None:
            print(f"  Triton kernels compiled during the run: {len(compiled)}", flush=True)
            for line in compiled:
                print(f"    {line[:400]}", flush=True)
        for line in step_phases(list(llm.llm_engine.step_log), started, started + watch.seconds):
            print(f"  {line}", flush=True)
        runs.append((row, tokens))
    return best(runs, key=lambda rt: rt[0].seconds)


def step_phases(log, started: float, ended: float, edges=(256, 192, 128, 64, 32, 8, 0)) -> list[str]:
    """Where a run's wall time went, from the engine's step log (time.time() of each step's
    launch): the steps grouped by the requests they carried (prefill steps apart), each group's
    steps, seconds and ms a step (from one step's launch to the next's, the last step's to the
    run's end), and the time before the first launch."""
    if not log:
        return []
    rows: dict[str, list[float]] = {"before the first step": [log[0].time - started]}
    for a, b in zip(log, log[1:] + [None]):
        if a.num_prefill_tokens:
            key = "with prefill"
        else:
            lo = next(e for e in edges if a.num_reqs >= e)
            key = f"decode, {lo}+ requests" if lo else "decode"
        rows.setdefault(key, []).append((b.time if b is not None else ended) - a.time)
    out = [f"step timeline ({len(log)} steps logged): group, steps, seconds, ms a step"]
    for key, dts in rows.items():
        out.append(f"{key:<24} {len(dts):>5} {sum(dts):7.3f} {1e3 * sum(dts) / len(dts):7.2f}")
    if rows.get("with prefill"):  # each, in order: the phase whose time varies most between runs
        out.append("with prefill, ms each: " + " ".join(f"{1e3 * dt:.0f}" for dt in rows["with prefill"]))
    return out


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"
