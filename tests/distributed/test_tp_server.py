"""The OpenAI server with --tensor-parallel-size 2 (a worker process next to the server's):
greedy completions equal the offline TP=1 engine's, and SIGTERM leaves no worker behind."""

from __future__ import annotations

import os
import time

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from server_process import ServerProcess
from tp_utils import engine, one_thread, process_gone, prompts_of

pytestmark = [pytest.mark.timeout(300)]


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_server_tp2_matches_offline_tp1(tmp_path, tokenizer_dir):
    import openai

    path = save_tiny_model(tiny_config("qwen3", heads=4, kv_heads=2, head_dim=16), str(tmp_path / "m"),
                           tokenizer_dir, seed=4)
    prompts = prompts_of([6, 31], seed=11)
    with one_thread(), engine(path, kv_cache_memory="8MiB", max_model_len=256) as llm:
        ref = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                                                        use_tqdm=False)]
    server = ServerProcess(["--model", path, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
                            "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--served-model-name", "tiny",
                            "--disable-log-stats"], str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        workers = children_of(server.proc.pid)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for prompt, text in zip(prompts, ref):
                out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0)
                assert out.choices[0].text == text
    finally:
        rc = server.stop()
    assert rc == 0, server.log_tail()
    deadline = time.monotonic() + 10.0  # children (ranks, multiprocessing's tracker) exit right after
    while not all(process_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers and all(process_gone(p) for p in workers), server.log_tail()
