"""Fixtures of the router tests: three real pagedllm servers of the tiny random Llama on
loopback (served as edge-model, region-model, center-model), started together once for the
directory; center takes one request at a time and queues none (so it answers 503 with
Retry-After when busy)."""

from __future__ import annotations

import pytest

from server_process import ServerProcess

COMMON_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--disable-uvicorn-access-log",
               "--disable-log-stats"]
SERVERS = {
    "edge": ["--served-model-name", "edge-model", "--max-num-seqs", "32"],
    "region": ["--served-model-name", "region-model", "--max-num-seqs", "32"],
    "center": ["--served-model-name", "center-model", "--max-num-seqs", "1", "--max-queue-len", "0"],
}


@pytest.fixture(scope="session")
def tier_servers(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_backends")
    servers = {name: ServerProcess(["--model", tiny_llama, *COMMON_ARGS, *args], str(logs / f"{name}.log"))
               for name, args in SERVERS.items()}
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()
