"""The server's lifecycle: admission control (--max-queue-len: 503 with Retry-After) and a
graceful stop (SIGTERM: in-flight streams end cleanly, the process exits 0)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import requests

from server_process import ServerProcess


def test_queue_full_then_sigterm_ends_streams_cleanly(tiny_llama, tmp_path):
    server = ServerProcess(
        ["--model", tiny_llama, "--max-model-len", "1024", "--kv-cache-memory", "16MiB", "--max-num-seqs", "1",
         "--max-queue-len", "0", "--shutdown-timeout", "0.3", "--disable-log-stats"],
        str(tmp_path / "server.log"),
    )
    try:
        server.wait_ready()
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            # long enough (about a second of decoding here) to outlast the 0.3 s shutdown timeout
            body = {"prompt": "A long story", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
            with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line:
                        events.append(line.decode())
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30), server.log_tail()

        # One request in flight, max_num_seqs=1 and no queue: the next one is turned away.
        r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"]
        assert r.json()["error"]["code"] == "queue_full"
        assert requests.get(server.url + "/health", timeout=5).status_code == 200

        server.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert not t.is_alive()
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort"  # cut at --shutdown-timeout, cleanly
        assert server.proc.wait(30) == 0, server.log_tail()
    finally:
        server.stop()


def test_sigint_while_loading_exits_0(tmp_path):
    # A model that takes a while to load (the embedded GGUF); Ctrl-C arrives mid-start.
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai_api_server", "--port", "0",
                             "--kv-cache-memory", "16MiB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.stderr.read().decode()[-3000:]


def test_bad_flag_value_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--block-size", "12",
                          "--kv-cache-memory", "16MiB"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "block_size" in out.stderr and "Traceback" not in out.stderr
