"""The real embedded model behind the server: SmolLM2-135M-Instruct knows the capital of France."""

from __future__ import annotations

import pytest

from server_process import ServerProcess


@pytest.mark.slow
def test_smollm2_answers_paris(tmp_path):
    import openai

    server = ServerProcess(["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--disable-log-stats"],
                           str(tmp_path / "server.log"))
    try:
        server.wait_ready(timeout=240)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            out = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=32,
                temperature=0.0,
            )
        answer = out.choices[0].message.content
        assert "Paris" in answer, answer
        assert out.choices[0].finish_reason in ("stop", "length")
    finally:
        rc = server.stop()
    assert rc == 0, server.log_tail()
