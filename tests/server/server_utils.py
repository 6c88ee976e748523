"""Helpers of the server tests: the real server started as a subprocess on 127.0.0.1 and a
free port (`python -m pagedllm.entrypoints.openai_api_server ...`), waited for through /health,
and stopped with SIGTERM, whose exit code the caller can check."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

API_KEY = "test-key"
# The tiny model's server: small KV cache (so usage is visible in /metrics) and short context.
TINY_MAX_MODEL_LEN = 512
TINY_SERVER_ARGS = [
    "--max-model-len", str(TINY_MAX_MODEL_LEN),
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "64",
    "--served-model-name", "tiny",
    "--api-key", API_KEY,
    "--max-request-body-size", "1MiB",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess; `url` is its base URL once `wait_ready` returned."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai_api_server",
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        pytest.fail(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait; SIGKILL (this process only) if it hangs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
