"""The OpenAI server under pipeline parallelism (the stages after the first in worker processes
next to the server's): completions (plain and streamed) equal the offline TP=1 engine's greedy
text on tiny Llama, Qwen3 and Qwen3-MoE models, at PP=2, PP=3 and TP=2 x PP=2. By default:
Qwen3 PP=2 (then stage 1 is killed: the request in flight gets an OpenAI-style 500 naming the
stage, /health turns 503 and the server exits with status 1, leaving no worker behind), Llama
TP=2 x PP=2 and MoE PP=2; the other six combinations are behind `extended` (a server each is
~15-25 s on 2 cores)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from conftest import save_tiny_model, tiny_config
from moe_utils import save_moe_model, tiny_moe_config
from pagedllm import SamplingParams
from server_process import ServerProcess
from test_tp_server import children_of
from tp_utils import engine, one_thread, process_gone, prompts_of

pytestmark = [pytest.mark.timeout(300)]

SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "32",
               "--served-model-name", "tiny", "--disable-log-stats"]
PROMPTS = prompts_of([6, 31, 70], seed=11)  # 70 tokens: chunked over three steps of 32


def stage_workers(server: ServerProcess) -> list[int]:
    """The server's worker processes (forked or spawned), not multiprocessing's resource tracker."""
    return [p for p in children_of(server.proc.pid)
            if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]


def offline_texts(path: str) -> list[str]:
    with one_thread(), engine(path, kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=32) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def check_completions(server: ServerProcess, ref: list[str]) -> None:
    import openai

    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0.0)
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == ref
        stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0.0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream) == ref[1]


def wait_gone(pids: list[int], server: ServerProcess) -> None:
    deadline = time.monotonic() + 10.0
    while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and all(process_gone(p) for p in pids), server.log_tail()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir):
    """name -> (checkpoint, offline TP=1 texts), each made when a test first asks for it."""
    made: dict[str, tuple[str, list[str]]] = {}

    def get(name: str) -> tuple[str, list[str]]:
        if name not in made:
            out = str(tmp_path_factory.mktemp(name))
            if name == "moe":  # Qwen3-MoE: layer 0 dense, layers 1-2 sparse
                path, _ = save_moe_model(tiny_moe_config("qwen3_moe"), out, tokenizer_dir)
            else:
                cfg = {"llama": tiny_config("llama", layers=4, heads=4, kv_heads=2),
                       "qwen3": tiny_config("qwen3", layers=3, tie=True, heads=4, kv_heads=2, head_dim=16)}[name]
                path = save_tiny_model(cfg, out, tokenizer_dir, seed=4)
            made[name] = path, offline_texts(path)
        return made[name]

    return get


CASES = [
    pytest.param("llama", 2, 2, None, id="llama-tp2xpp2"),
    pytest.param("moe", 1, 2, None, id="moe-pp2"),
    # vLLM's variable, read by the server process: Llama's 4 layers split 1 | 3
    pytest.param("llama", 1, 2, "1,3", id="llama-pp2-split13", marks=pytest.mark.extended),
    pytest.param("llama", 1, 3, None, id="llama-pp3", marks=pytest.mark.extended),
    pytest.param("qwen3", 1, 3, None, id="qwen3-pp3", marks=pytest.mark.extended),
    pytest.param("qwen3", 2, 2, None, id="qwen3-tp2xpp2", marks=pytest.mark.extended),
    pytest.param("moe", 1, 3, None, id="moe-pp3", marks=pytest.mark.extended),
    pytest.param("moe", 2, 2, None, id="moe-tp2xpp2", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("model,tp,pp,split", CASES)
def test_server_pipeline_matches_offline(models, tmp_path, model, tp, pp, split):
    path, ref = models(model)
    env = {"VLLM_PP_LAYER_PARTITION": split} if split else None
    server = ServerProcess(["--model", path, "-tp", str(tp), "-pp", str(pp), *SERVER_ARGS],
                           str(tmp_path / "server.log"), env=env)
    try:
        server.wait_ready()
        workers = stage_workers(server)
        assert len(workers) == tp * pp - 1, workers
        if split:
            assert f"stage 0/2 (layers 0-{int(split.split(',')[0]) - 1})" in server.log_text()
        check_completions(server, ref)
        assert not server.unhandled_errors(), server.unhandled_errors()
    finally:
        rc = server.stop()
    assert rc == 0, server.log_tail()
    wait_gone(workers, server)


def test_server_pp2_matches_offline_and_exits_when_a_stage_dies(models, tmp_path):
    path, ref = models("qwen3")
    server = ServerProcess(["--model", path, "-pp", "2", *SERVER_ARGS], str(tmp_path / "server.log"))
    try:
        server.wait_ready()
        workers = stage_workers(server)
        assert len(workers) == 1, workers
        check_completions(server, ref)

        os.kill(workers[0], signal.SIGKILL)
        r = requests.post(server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12})
        assert r.status_code == 500, r.text
        assert "pipeline stage 1" in r.json()["error"]["message"]
        assert server.proc.wait(30) == 1, server.log_tail()
    finally:
        server.stop()
    wait_gone(workers, server)
