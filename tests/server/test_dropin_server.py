"""vLLM users' command lines against the real server: the founding document's command line as
written (module entry point, -tp 2 and its tuning flags) serves a hub id from an offline cache
and answers a chat request, each flag that cannot apply logged once; `pagedllm serve org/name`
with several API keys, CORS, TLS and a root path; GET /v1/models/{id}."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests
from hub_cache import add_repo, dir_files, resave_with_seed
from server_process import ServerProcess

REPO = "org/tiny-llama-4k"
SEED_FLAGS = ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.95", "--max-num-batched-tokens",
              "51200", "--disable-log-stats", "--cache-block-size", "4096", "--max-seq-length", "4096",
              "--swap-space", "10G", "--batch-wait-timeout", "100", "--max-num-seqs", "8"]
CHAT = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("dropin")
    # the seed asks for --max-seq-length 4096: a model that has that many positions
    src = resave_with_seed(tiny_llama, str(root / "src"), seed=0, max_position_embeddings=4096)
    home = str(root / "hf_home")
    add_repo(home, REPO, dir_files(src))
    return home


@pytest.fixture(scope="module")
def seed_server(hf_home, tmp_path_factory):
    env = {"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1", "PAGEDLLM_API_KEY": "", "VLLM_API_KEY": ""}
    server = ServerProcess(["--model", REPO, *SEED_FLAGS, "--kv-cache-memory", "16MiB"],
                           str(tmp_path_factory.mktemp("logs") / "seed.log"), env=env)
    server.wait_ready(300)
    yield server
    assert server.stop() == 0, server.log_tail()


def test_seed_command_line_serves_a_chat(seed_server):
    r = requests.post(seed_server.url + "/v1/chat/completions", json={"model": REPO, **CHAT}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == REPO and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5
    log = seed_server.log_text()
    for line in ("gpu_memory_utilization=0.95 does not apply on a CPU", "swap_space=10 GiB is not used",
                 "block_size=4096 is more tokens than the paged kernels use"):
        assert log.count(line) == 1, line
    assert "--host 0.0.0.0 binds every interface" in log
    assert not seed_server.unhandled_errors()
    # CORS is off by default
    pre = requests.options(seed_server.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers


def test_model_card_by_id(seed_server):
    r = requests.get(f"{seed_server.url}/v1/models/{REPO}", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == REPO and r.json()["object"] == "model"
    r = requests.get(f"{seed_server.url}/v1/models/org/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    key, cert = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def test_serve_hub_id_with_keys_cors_tls_root_path(hf_home, tls, tmp_path):
    key, cert = tls
    server = ServerProcess(
        ["--api-key", "k1", "k2", "--allowed-origins", '["https://a.example"]', "--ssl-keyfile", key,
         "--ssl-certfile", cert, "--root-path", "/api", "--kv-cache-memory", "16MiB", "--max-model-len", "256"],
        str(tmp_path / "serve.log"), env={"HF_HOME": hf_home, "HF_HUB_OFFLINE": "1"},
        command=[sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", REPO], scheme="https")
    server.verify = cert
    try:
        server.wait_ready(300)
        url = server.url + "/v1/chat/completions"
        for k in ("k1", "k2"):
            r = requests.post(url, json=CHAT, headers={"Authorization": f"Bearer {k}"}, verify=cert, timeout=120)
            assert r.status_code == 200, r.text
        r = requests.post(url, json=CHAT, headers={"Authorization": "Bearer k3"}, verify=cert, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        models = requests.get(server.url + "/v1/models", headers={"Authorization": "Bearer k2"}, verify=cert,
                              timeout=10).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        pre = {"Access-Control-Request-Method": "POST"}
        ok = requests.options(url, headers={"Origin": "https://a.example", **pre}, verify=cert, timeout=10)
        assert ok.headers.get("access-control-allow-origin") == "https://a.example"
        other = requests.options(url, headers={"Origin": "https://b.example", **pre}, verify=cert, timeout=10)
        assert "access-control-allow-origin" not in other.headers
        assert f"https://127.0.0.1:{server.port}/api" in server.log_text()
        openapi = requests.get(server.url + "/openapi.json", verify=cert, timeout=10).json()
        assert openapi.get("servers", [{}])[0].get("url") == "/api"
    finally:
        assert server.stop() == 0, server.log_tail()


def test_vllm_api_key_env():
    from types import SimpleNamespace

    from pagedllm.entrypoints.server_options import api_keys

    assert api_keys(SimpleNamespace(api_key=None), {"VLLM_API_KEY": "v"}) == ["v"]
    assert api_keys(SimpleNamespace(api_key=None), {"VLLM_API_KEY": "v", "PAGEDLLM_API_KEY": "p"}) == ["p"]
    assert api_keys(SimpleNamespace(api_key=["a", "b"]), {"VLLM_API_KEY": "v"}) == ["a", "b"]
    assert api_keys(SimpleNamespace(api_key=None), {}) == []
