"""The real router as a test fixture: `python -m pagedllm.entrypoints.cli router --config FILE`
as a subprocess on 127.0.0.1 and a free port (the YAML written from a dict), waited for through
its /health, stopped with SIGTERM; plus readers of a backend's Prometheus figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import requests
import yaml

from server_process import HOST, ServerProcess, free_port

ROUTER_KEY = "router-key"


class RouterProcess(ServerProcess):
    """ServerProcess's waiting, logs and SIGTERM stop, around the router's command."""

    def __init__(self, config: dict, tmp_dir: str, name: str = "router") -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.verify: str | bool = True  # ServerProcess.wait_ready reads it (https servers)
        config_path = os.path.join(tmp_dir, f"{name}.yaml")
        with open(config_path, "w") as f:
            yaml.safe_dump({**config, "host": HOST, "port": self.port}, f)
        self.log_path = os.path.join(tmp_dir, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--config", config_path],
            stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ROUTER_KEY}"}

    def post(self, path: str, body: dict, timeout: float = 60, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=self.headers(), timeout=timeout, **kw)

    def backends(self) -> list[dict]:
        return requests.get(self.url + "/router/backends", headers=self.headers(), timeout=5).json()["backends"]

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=5).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these label values) in a Prometheus exposition."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", text, re.MULTILINE):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def backend_metric(url: str, name: str, **labels: str) -> float:
    return metric_sum(requests.get(url + "/metrics", timeout=5).text, name, **labels)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
