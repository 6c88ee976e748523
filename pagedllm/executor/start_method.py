"""How tensor-parallel worker processes are started, and the one line said when one cannot start.

The start method, as vLLM picks it:
- `$PAGEDLLM_WORKER_MULTIPROC_METHOD` (or vLLM's `$VLLM_WORKER_MULTIPROC_METHOD`) when set;
- spawn when this process has a CUDA context (a forked child cannot use it);
- fork when the main module is a script file (`python script.py`, the `pagedllm` command): spawn
  would re-run the script's top level in every worker, so a script without an
  `if __name__ == "__main__":` guard (the founding document's example) only works forked;
- spawn otherwise (`python -m ...`, pytest, a notebook): the process may already have run torch's
  OpenMP threads, which a forked child would inherit in a state that deadlocks.

A spawned worker that finds itself re-running a script's top level (no guard) prints one line
saying so and exits, instead of multiprocessing's 150-line RuntimeError; the engine then raises
`WorkerStartError`, one line naming the cause and the fix.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

START_METHODS = ("fork", "spawn", "forkserver")
_ENV_VARS = ("PAGEDLLM_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD")
_GUARD_FIX = (
    'put the code that builds the engine under `if __name__ == "__main__":`, or run it '
    "with PAGEDLLM_WORKER_MULTIPROC_METHOD=fork (only when CUDA is not initialised before the engine)"
)


class WorkerStartError(RuntimeError):
    """A tensor-parallel worker process did not start; the message is one line: cause and fix."""


def worker_start_method() -> str:
    for var in _ENV_VARS:
        value = os.environ.get(var, "").strip().lower()
        if value:
            if value not in START_METHODS:
                raise ValueError(f"{var} must be one of {', '.join(START_METHODS)}, got {value!r}")
            return value
    import torch

    if torch.cuda.is_initialized():
        return "spawn"
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", None) and getattr(main, "__spec__", None) is None:
        return "fork"
    return "spawn"


def in_spawn_bootstrap() -> bool:
    """True while a spawned child imports the parent's main module (before its target runs)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def refuse_in_spawn_bootstrap() -> None:
    """Called before starting workers: in a spawned worker that is re-running a script's top level,
    say so in one line and exit (the engine that spawned it reports the failure)."""
    if in_spawn_bootstrap():
        print(
            f"pagedllm: a spawned tensor-parallel worker re-ran the script's top level, which builds "
            f"another engine; {_GUARD_FIX}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1)


def start_failure_line(rank: int, method: str, message: str) -> str:
    """One line from the executor's report of a worker that did not start: which worker, why (the
    last line of its error, or how it exited), and the fix."""
    silent = "its error:" not in message and "failed:\n" not in message  # it died without a word
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    cause = lines[-1] if lines else "no error was reported"
    if silent:
        cause = cause.split(";")[0].split(") ", 1)[-1]  # "exited with code 1"
    fix = "the same arguments at tensor_parallel_size=1 show whether the model itself loads"
    low = message.lower()
    if method in ("spawn", "forkserver") and silent:
        cause = (
            f"it {cause} while importing the main module (start method {method!r}: a spawned worker "
            "re-runs the script's top level)"
        )
        fix = _GUARD_FIX
    elif "out of memory" in low:
        fix = "lower gpu_memory_utilization, max_num_seqs or max_model_len, or use more ranks"
    return f"tensor-parallel worker rank {rank} failed to start: {cause}. Fix: {fix}"
