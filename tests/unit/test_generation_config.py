"""generation_config="auto" (the default): the model's generation_config.json sampling fields are
the defaults of requests that leave them unset (offline generate without SamplingParams; server
fields that are absent); "vllm" keeps the plain defaults; override_generation_config goes over."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams

SMALL = dict(kv_cache_memory="8MiB", max_model_len=128)


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gen_cfg") / "m")
    shutil.copytree(tiny_llama, d)
    path = os.path.join(d, "generation_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(temperature=0.0, top_k=5, top_p=0.8, repetition_penalty=1.1, max_new_tokens=7)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def test_auto_applies_generation_config(model_with_defaults):
    llm = LLM(model_with_defaults, **SMALL)
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.max_tokens) == (0.0, 5, 0.8, 1.1, 7)
    out = llm.generate([[5, 17, 300, 42]], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 7
    # greedy (temperature 0 from the file): the same tokens as explicit greedy with those fields
    explicit = SamplingParams(temperature=0, top_k=5, top_p=0.8, repetition_penalty=1.1, max_tokens=7)
    assert out.token_ids == llm.generate([[5, 17, 300, 42]], explicit, use_tqdm=False)[0].outputs[0].token_ids


def test_vllm_mode_and_override(model_with_defaults):
    plain = LLM(model_with_defaults, generation_config="vllm", **SMALL).get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)
    over = LLM(model_with_defaults, override_generation_config={"temperature": 0.5}, **SMALL)
    sp = over.get_default_sampling_params()
    assert (sp.temperature, sp.top_k) == (0.5, 5)
    with pytest.raises(ValueError, match="override_generation_config"):
        LLM(model_with_defaults, override_generation_config={"beam_width": 3}, **SMALL)


def test_server_requests_take_the_defaults_they_leave_unset(model_with_defaults):
    """On the server: an absent max_tokens is generation_config.json's max_new_tokens (7), an
    absent temperature its 0.0 (greedy, so two requests agree); fields the request sets win."""
    from fastapi.testclient import TestClient

    from pagedllm import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model_with_defaults, **SMALL))
    try:
        app = build_app(engine, served_model_names=["m"], max_model_len=128, vocab_size=49152)
        with TestClient(app) as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
            a = http.post("/v1/chat/completions", json=body).json()
            b = http.post("/v1/chat/completions", json=body).json()
            assert a["usage"]["completion_tokens"] == 7 and a["choices"][0]["finish_reason"] == "length"
            assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
            c = http.post("/v1/chat/completions", json={**body, "max_tokens": 10}).json()
            assert c["usage"]["completion_tokens"] == 10
    finally:
        engine.shutdown()
