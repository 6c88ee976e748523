"""The OpenAI server with --pipeline-parallel-size 2 (stage 1 in a worker process next to the
server's): completions (plain and streamed) equal the offline TP=1 engine's greedy text; when
stage 1 is killed, the request in flight gets an OpenAI-style 500 naming the stage, /health
turns 503 and the server exits with status 1, leaving no worker behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from server_process import ServerProcess
from test_tp_server import children_of
from tp_utils import engine, one_thread, process_gone, prompts_of

pytestmark = [pytest.mark.timeout(300)]


def test_server_pp2_matches_offline_and_exits_when_a_stage_dies(tmp_path, tokenizer_dir):
    import openai

    path = save_tiny_model(tiny_config("qwen3", layers=3, tie=True, heads=4, kv_heads=2, head_dim=16),
                           str(tmp_path / "m"), tokenizer_dir, seed=4)
    prompts = prompts_of([6, 31, 70], seed=11)
    kw = dict(kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=32)
    with one_thread(), engine(path, **kw) as llm:
        ref = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                                                        use_tqdm=False)]
    server = ServerProcess(["--model", path, "-pp", "2", "--max-model-len", "256", "--kv-cache-memory", "8MiB",
                            "--max-num-batched-tokens", "32", "--served-model-name", "tiny", "--disable-log-stats"],
                           str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        workers = children_of(server.proc.pid)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            out = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0.0)
            assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == ref
            stream = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=12, temperature=0.0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in stream) == ref[1]

        # the stage-1 worker (forked or spawned), not multiprocessing's resource tracker
        stage1 = [p for p in workers if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(stage1) == 1, workers
        os.kill(stage1[0], signal.SIGKILL)
        r = requests.post(server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompts[0], "max_tokens": 12})
        assert r.status_code == 500, r.text
        assert "pipeline stage 1" in r.json()["error"]["message"]
        assert server.proc.wait(30) == 1, server.log_tail()
    finally:
        server.stop()
    deadline = time.monotonic() + 10.0
    while not all(process_gone(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers and all(process_gone(p) for p in workers), server.log_tail()
