"""The OpenAI server on Ray (`--distributed-executor-backend ray`, a local cluster the server
starts): -pp 2 and -dp 2 answer completions with the offline single engine's greedy text, and
SIGTERM stops the server with status 0, leaving none of its processes (Ray's included) behind.
Behind `extended` (~35 s a server: Ray starts inside it on 2 cores); skipped without ray."""

from __future__ import annotations

import os
import time

import pytest
import requests

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from server_process import ServerProcess
from test_tp_server import children_of
from tp_utils import engine, one_thread, process_gone, prompts_of

pytest.importorskip("ray")

pytestmark = [pytest.mark.timeout(300), pytest.mark.extended]

PROMPTS = prompts_of([5, 30, 60], seed=12)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    path = save_tiny_model(tiny_config("llama", layers=3, heads=4, kv_heads=2), str(tmp_path_factory.mktemp("m")),
                           tokenizer_dir, seed=5)
    with one_thread(), engine(path, kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=32) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    return path, [o.outputs[0].text for o in outs]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.parametrize("parallel", [["-pp", "2"], ["-dp", "2"]], ids=["pp2", "dp2"])
def test_server_on_ray_matches_offline_and_exits_cleanly(model, tmp_path, parallel):
    path, ref = model
    env = {k: "" for k in ("RAY_ADDRESS",) if k in os.environ}  # a local cluster of its own
    args = ["--model", path, *parallel, "--distributed-executor-backend", "ray", "--max-model-len", "256",
            "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "32", "--served-model-name", "tiny",
            "--disable-log-stats"]
    server = ServerProcess(args, str(tmp_path / "server.log"), env=env)
    procs: list[int] = []
    try:
        server.wait_ready()
        r = requests.post(server.url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": PROMPTS, "max_tokens": 10, "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] == ref
        procs = descendants(server.proc.pid)  # Ray's processes and its actors
        assert len(procs) >= 3, procs
    finally:
        rc = server.stop(timeout=60)
    assert rc == 0, server.log_tail()
    deadline = time.monotonic() + 30
    while not all(process_gone(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(process_gone(p) for p in procs), [open(f"/proc/{p}/cmdline", "rb").read() for p in procs
                                                 if not process_gone(p)]
