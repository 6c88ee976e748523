"""Fixtures of the server tests: one tiny-model server for the whole session."""

from __future__ import annotations

import pytest

from server_process import ServerProcess
from server_utils import API_KEY, TINY_SERVER_ARGS


@pytest.fixture(scope="session")
def tiny_server(tiny_llama, tmp_path_factory):
    server = ServerProcess(["--model", tiny_llama, *TINY_SERVER_ARGS],
                           str(tmp_path_factory.mktemp("logs") / "tiny_server.log"))
    server.wait_ready()
    yield server
    rc = server.stop()
    assert rc == 0, f"server exited with {rc} on SIGTERM:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def client(tiny_server):
    import openai

    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture()
def async_client(tiny_server):
    import openai

    return openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
