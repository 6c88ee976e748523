"""How the multiprocess executor lives and dies: a worker that dies or fails surfaces as a
RuntimeError naming its rank (never a hang), two engines in one process do not collide,
shutdown and the end of the engine's process leave no worker behind, bad settings are
refused with ValueError."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from pagedllm.config import EngineArgs
from tp_utils import engine, one_thread, process_gone, prompts_of, token_ids

pytestmark = pytest.mark.timeout(180)

SMALL = dict(kv_cache_memory="4MiB", max_model_len=512)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _routed(monkeypatch):
    with one_thread():
        yield


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir) -> str:
    return save_tiny_model(tiny_config("llama", heads=4, kv_heads=2), str(tmp_path_factory.mktemp("llama")),
                           tokenizer_dir, seed=3)


def wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_killed_idle_worker_is_an_error_not_a_hang(llama):
    with engine(llama, tensor_parallel_size=2, **SMALL) as llm:
        [pid] = llm.llm_engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 .*SIGKILL"):
            token_ids(llm, prompts_of([12, 30]))
        with pytest.raises(RuntimeError, match=r"rank 1"):  # and it stays failed
            token_ids(llm, prompts_of([4]))
        assert time.monotonic() - t0 < 20
        assert not llm.llm_engine.has_unfinished_requests()


def test_worker_killed_mid_generation_is_an_error_not_a_hang(llama):
    with engine(llama, tensor_parallel_size=2, **SMALL) as llm:
        [pid] = llm.llm_engine.executor.worker_pids
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match=r"rank 1 .*SIGKILL"):
                token_ids(llm, prompts_of([20] * 8), SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True))
        finally:
            killer.cancel()
        assert time.monotonic() - t0 < 30


def test_failing_worker_reports_its_traceback(llama):
    with engine(llama, tensor_parallel_size=2, **SMALL) as llm:
        ex = llm.llm_engine.executor
        ex._shared.workers[0].conn.send(("execute_model", (None,), False))  # a step only rank 1 sees
        with pytest.raises(RuntimeError, match=r"(?s)rank 1 .*exited with code 1.*Traceback.*AttributeError"):
            token_ids(llm, prompts_of([8]))


def test_two_engines_in_one_process_do_not_collide(llama):
    prompts = prompts_of([7, 25, 60], seed=4)
    with engine(llama, **SMALL) as ref_llm:
        ref = token_ids(ref_llm, prompts)
    with engine(llama, tensor_parallel_size=2, **SMALL) as a, engine(llama, tensor_parallel_size=2, **SMALL) as b:
        assert a.llm_engine.executor._store.port != b.llm_engine.executor._store.port
        assert token_ids(a, prompts[:1]) == ref[:1]
        assert token_ids(b, prompts) == ref
        assert token_ids(a, prompts) == ref


def test_shutdown_stops_the_workers(llama):
    import torch

    threads = torch.get_num_threads()
    with engine(llama, tensor_parallel_size=2, **SMALL) as llm:
        ex = llm.llm_engine.executor
        pids = ex.worker_pids
        token_ids(llm, prompts_of([5]))
    assert all(process_gone(p) for p in pids)
    ex.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        ex.execute_model(None)
    assert torch.get_num_threads() == threads


CHILD = """
import sys, time
sys.path[:0] = [{tests!r}, {dist!r}]
from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory="4MiB", max_model_len=256)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    print("PIDS", *llm.llm_engine.executor.worker_pids, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
"""


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_workers_end_with_the_engine_process(llama, tmp_path, how):
    """A script that ends without shutting down (atexit finalizer), or whose process is
    SIGKILLed (the workers watch their parent), leaves no worker behind."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=os.path.dirname(TESTS_DIR), dist=TESTS_DIR))
    proc = subprocess.Popen([sys.executable, str(script), llama, "hang" if how == "killed" else "exit"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        for line in proc.stdout:
            if line.startswith("PIDS"):
                break
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 1, line
        if how == "killed":
            proc.kill()
        assert proc.wait(60) == (-signal.SIGKILL if how == "killed" else 0)
        assert wait_gone(pids[0]), f"worker {pids[0]} outlived the engine's process"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_settings_are_refused(tmp_path):
    def config(tp: int, heads: int, kv: int, **kw):
        d = tmp_path / f"h{heads}kv{kv}"
        if not d.exists():
            cfg = tiny_config("llama", heads=heads, kv_heads=kv, hidden=heads * 16)
            cfg.architectures = ["LlamaForCausalLM"]
            cfg.save_pretrained(d)
        return EngineArgs(model=str(d), tensor_parallel_size=tp, **kw).create_engine_config()

    with pytest.raises(ValueError, match="num_attention_heads=4"):
        config(3, 4, 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        config(2, 6, 3)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        config(2, 4, 2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        config(2, 4, 2, distributed_executor_backend="slurm")
    assert config(4, 4, 2).parallel_config.distributed_executor_backend == "mp"  # kv heads replicated
    assert config(1, 4, 2).parallel_config.distributed_executor_backend == "uni"


def test_cli_passes_the_parallel_flags():
    from pagedllm.entrypoints.cli import build_parser, engine_args_from_namespace

    ns = build_parser().parse_args(["serve", "m", "-tp", "2", "--distributed-executor-backend", "ray"])
    args = engine_args_from_namespace(ns)
    assert args.tensor_parallel_size == 2 and args.distributed_executor_backend == "ray"
    ns = build_parser().parse_args(["serve", "m"])
    assert engine_args_from_namespace(ns).distributed_executor_backend is None
