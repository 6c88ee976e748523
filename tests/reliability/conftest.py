"""Fixtures of the reliability suite: one small-KV-cache server of the tiny random Llama shared by
the suite (bad input, disconnects, overload, soak, fuzzing, security), and the offline LLM on
the same weights as the reference for what a correct answer is."""

from __future__ import annotations

import pytest

from reliability_utils import MAX_MODEL_LEN, SERVER_ARGS, ServerProcess


@pytest.fixture(scope="session")
def rel_server(tiny_llama, tmp_path_factory):
    server = ServerProcess(["--model", tiny_llama, *SERVER_ARGS],
                           str(tmp_path_factory.mktemp("reliability") / "server.log"))
    try:
        server.wait_ready()
        yield server
    finally:
        rc = server.stop()
    assert rc == 0, f"server exited with {rc} on SIGTERM:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def offline_llm(tiny_llama):
    """The offline engine on the server's weights, with room to run a whole burst at once."""
    from pagedllm import LLM

    return LLM(model=tiny_llama, max_model_len=MAX_MODEL_LEN, kv_cache_memory="16MiB")

