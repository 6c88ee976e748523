"""The real server as a test fixture: `python -m pagedllm.entrypoints.openai_api_server` started
as a subprocess on 127.0.0.1 and a free port, waited for through /health, its log, resident
memory and unhandled exceptions at hand, stopped with SIGTERM (whose exit code the caller can
check). Shared by tests/server and tests/reliability."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests

HOST = "127.0.0.1"

# Lines that mean an exception escaped somewhere in the server.
_UNHANDLED = re.compile(
    r"Traceback \(most recent call last\)|Exception in ASGI application|Task exception was never retrieved"
    r"|^ERROR ",
    re.MULTILINE,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m pagedllm.entrypoints.openai_api_server` on 127.0.0.1 and a free port."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None, scheme: str = "http") -> None:
        """command: what runs instead of the module entry point (e.g. `... cli serve MODEL`)."""
        self.port = free_port()
        self.url = f"{scheme}://{HOST}:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [*(command or [sys.executable, "-m", "pagedllm.entrypoints.openai_api_server"]),
               "--host", HOST, "--port", str(self.port), *args]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        full_env.pop("PAGEDLLM_TEST_FAULT", None)
        full_env.update(env or {})
        self.verify: str | bool = True  # a CA file for an https server with a self-signed certificate
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def unhandled_errors(self, since: int = 0) -> list[str]:
        """Log lines (from character `since` on) that show an exception escaping."""
        text = self.log_text()[since:]
        return [text[max(0, m.start() - 200): m.end() + 300] for m in _UNHANDLED.finditer(text)]

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def rss_kib(self) -> int:
        """Resident memory of the server process (VmRSS), in KiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS in /proc status")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait; SIGKILL (this process only) if it hangs. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode
