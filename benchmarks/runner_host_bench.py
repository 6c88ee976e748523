"""Host time of the runner's per-step input work at N running requests: ModelRunner.prepare_inputs
and ._sampling_batch of one all-decode step, each timed in place (both are pure: they read the
runner's state and change nothing), median of 200 calls. Runs on any tree (main's before the
persistent input batch too), on the CPU with a tiny model:

    PYTHONPATH=. python benchmarks/runner_host_bench.py MODEL_DIR [N] [--penalties]
"""
import random, sys, time, statistics
from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

args = [a for a in sys.argv[1:] if not a.startswith("--")]
path, n = args[0], int(args[1]) if len(args) > 1 else 256
extra = dict(repetition_penalty=1.1, min_tokens=4) if "--penalties" in sys.argv else {}
eng = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="256MiB", max_model_len=1024,
                                            max_num_seqs=n, max_num_batched_tokens=max(2048, n), async_scheduling=False))
rng = random.Random(0)
for i in range(n):
    eng.add_request(str(i), [rng.randrange(3, 40000) for _ in range(rng.randint(50, 500))],
                    SamplingParams(temperature=0.6, max_tokens=500, ignore_eos=True, **extra))
runner = eng.executor.worker.runner
res = {}
def timed(name, fn):
    def wrap(*a):
        so_ok = res.get("armed")
        if so_ok and name not in res:
            ts = []
            for _ in range(200):
                t0 = time.perf_counter(); fn(*a); ts.append(time.perf_counter() - t0)
            res[name] = statistics.median(ts)
        return fn(*a)
    return wrap
runner.prepare_inputs = timed("prepare_inputs", runner.prepare_inputs)
runner._sampling_batch = timed("sampling", runner._sampling_batch)
real = runner.launch
def launch(so):
    res["armed"] = so.num_decodes == n and so.total_num_scheduled_tokens == n
    return real(so)
runner.launch = launch
for _ in range(600):
    eng.step()
    if "sampling" in res:
        break
tree = "new" if hasattr(runner, "input_batch") else "main"
print(f"{tree}: {n} decodes{' (penalties, min_tokens)' if extra else ''}: prepare_inputs {1e3 * res['prepare_inputs']:.3f} ms"
      f" + sampling inputs {1e3 * res['sampling']:.3f} ms (medians of 200)")
