"""Security properties of the server, each checked where it can be:

- the API key guards every /v1 route (all that the server's schema lists, and unknown ones),
  and is compared in constant time (equal-length digests through hmac.compare_digest);
- the server binds 127.0.0.1 unless told otherwise;
- request bodies have a size limit, also when sent chunked;
- weights come only from safetensors or GGUF: a pickled checkpoint is refused, never unpickled;
- nothing in a request reaches the filesystem: the request handlers open no file, and the
  fields that could name one (model, chat template, image URLs) are rejected.
"""

from __future__ import annotations

import ast
import os
import pickle
import shutil
from pathlib import Path

import pytest
import requests

import pagedllm
from reliability_utils import API_KEY, AUTH, BODY_LIMIT, assert_healthy

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(pagedllm.__file__).parent


# ---- the API key ----------------------------------------------------------------------------------


def test_every_v1_route_needs_the_key(rel_server):
    schema = requests.get(rel_server.url + "/openapi.json", timeout=10).json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops
              if path.startswith("/v1")]
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")} <= set(routes)
    routes += [("GET", "/v1"), ("POST", "/v1/embeddings"), ("DELETE", "/v1/models")]  # unknown ones too
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY},
                        {"X-API-Key": API_KEY}, {"Authorization": f"bearer {API_KEY}x"}):
            r = requests.request(method, rel_server.url + path, json={}, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = requests.request(method, rel_server.url + path, json={}, headers=AUTH, timeout=10)
        assert r.status_code != 401, (method, path)
    # Outside /v1 (health checks, metrics scrapers) no key is needed.
    for path in ("/health", "/version", "/metrics"):
        assert requests.get(rel_server.url + path, timeout=10).status_code == 200


def test_key_is_compared_in_constant_time(monkeypatch):
    from pagedllm.entrypoints.openai import guard as guard_module

    compared: list[tuple[int, int]] = []
    real = guard_module.hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", spy)
    guard = guard_module.GuardMiddleware(None, api_key="s3cret-key", max_body_size=1)
    for header, ok in [(b"Bearer s3cret-key", True), (b"Bearer s3cret-kex", False), (b"Bearer s", False),
                       (b"Bearer " + b"s" * 10_000, False), (b"Bearer ", False), (b"", False),
                       (b"Basic s3cret-key", False), (b"bearer s3cret-key", True)]:
        compared.clear()
        assert guard._authorized(header) is ok, header
        # One comparison, of two equal-length digests, whatever was sent: no early exit that
        # depends on the key's length or content.
        assert compared == [(32, 32)], (header, compared)


# ---- binding and size limits ---------------------------------------------------------------------


def test_default_bind_is_loopback():
    from pagedllm.entrypoints import cli, openai_api_server

    assert openai_api_server.build_parser().parse_args([]).host == "127.0.0.1"
    assert cli.build_parser().parse_args(["serve"]).host == "127.0.0.1"
    makefile = (PACKAGE.parent / "Makefile").read_text()
    assert "HOST ?= 127.0.0.1" in makefile


def test_body_size_limit_has_a_default_and_holds_chunked(rel_server):
    from pagedllm.entrypoints import openai_api_server

    assert openai_api_server.build_parser().parse_args([]).max_request_body_size == 8 << 20

    def chunks():
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b"x" * 4096

    r = requests.post(rel_server.url + "/v1/completions", data=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # Without a key the body is not even read: 401 first.
    r = requests.post(rel_server.url + "/v1/completions", data=chunks(), timeout=30)
    assert r.status_code == 401
    assert_healthy(rel_server)


# ---- weights ------------------------------------------------------------------------------------


class _Bomb:
    """Unpickling this creates the file `marker`: the proof that a pickle was loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.safetensors"])
def test_pickled_weights_are_never_loaded(tiny_llama, tmp_path, name):
    from pagedllm import LLM

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model, ignore=shutil.ignore_patterns("*.safetensors"))
    marker = tmp_path / "unpickled"
    with open(model / name, "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Bomb(str(marker))}, f)
    with pytest.raises(Exception) as info:
        LLM(model=str(model), max_model_len=64, kv_cache_memory="1MiB")
    assert not marker.exists(), "a pickled checkpoint was unpickled"
    if name != "model.safetensors":
        assert "safetensors" in str(info.value)


def _source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_no_pickle_loading_anywhere_in_the_package():
    offenders = []
    for path in _source_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "cPickle", "dill", "joblib", "shelve") for n in names):
                    offenders.append(f"{path}:{node.lineno} imports a pickle module")
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                if func in ("torch.load", "torch.jit.load", "np.load", "numpy.load"):
                    pickle_off = any(k.arg == "allow_pickle" and ast.unparse(k.value) == "False" for k in node.keywords)
                    weights_only = any(k.arg == "weights_only" and ast.unparse(k.value) == "True"
                                       for k in node.keywords)
                    if not (pickle_off or weights_only):
                        offenders.append(f"{path}:{node.lineno} calls {func}")
    assert offenders == []


# ---- no path from a request to the filesystem --------------------------------------------------

_FS_CALLS = {"open", "io.open", "os.open", "os.listdir", "os.scandir", "os.walk", "os.stat", "os.remove",
             "os.unlink", "os.makedirs", "os.mkdir", "os.rename", "glob.glob", "shutil.copy", "shutil.rmtree",
             "Path", "pathlib.Path", "os.path.isfile", "os.path.exists", "os.path.isdir", "os.path.join",
             "safe_open", "np.memmap", "numpy.memmap"}
# The one place the server reads a file: the --chat-template flag, at start-up.
# start-up only: the --chat-template file, the engine page's static files
_ALLOWED = {("api_server.py", "_read_chat_template"), ("engine_page.py", "_read_static_files")}


def test_request_handlers_touch_no_file():
    offenders = []
    for path in sorted((PACKAGE / "entrypoints" / "openai").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and ast.unparse(node.func) in _FS_CALLS:
                    if (path.name, func.name) not in _ALLOWED:
                        offenders.append(f"{path.name}:{node.lineno} {func.name}() calls {ast.unparse(node.func)}")
    assert offenders == []


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": 2, "model": "/etc/passwd"}, 404, "model"),
    ({"prompt": "x", "max_tokens": 2, "model": "file:///etc/passwd"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
      "chat_template_kwargs": {"chat_template": "/etc/passwd"}}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
      "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
      "max_tokens": 2}, 400, "messages.0.content"),
])
def test_fields_that_could_name_a_file_are_rejected(rel_server, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = requests.post(rel_server.url + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert "root:" not in r.text


def test_chat_template_kwargs_reach_only_the_template(rel_server):
    # Harmless template variables are fine; they are data for the sandboxed template.
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "chat_template_kwargs": {"enable_thinking": False, "path": os.sep + "etc"}}
    r = requests.post(rel_server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
