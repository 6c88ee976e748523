"""Hub model ids resolved from a real Hugging Face cache layout in a temp HF_HOME, offline:
`LLM("org/name")` generates what the same model from its directory generates, `revision`,
`download_dir`, `HF_HUB_CACHE` and a tokenizer id are honoured, a GGUF repo takes its file as
`repo:FILE.gguf` or `gguf_file`, and a missing id is one clear line."""

from __future__ import annotations

import os

import pytest
from hub_cache import add_repo, dir_files, resave_with_seed

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.config import default_model_path
from pagedllm.model.hub import local_model_name, resolve_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 300, 42, 7]
SMALL = dict(kv_cache_memory="8MiB", max_model_len=256)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama):
    """HF_HOME with org/tiny-llama (main, and a different model on branch dev) and a GGUF repo."""
    root = tmp_path_factory.mktemp("hub")
    main_dir = tiny_llama
    dev_dir = resave_with_seed(tiny_llama, str(root / "dev_src"), seed=1)
    home = str(root / "hf_home")
    add_repo(home, "org/tiny-llama", dir_files(main_dir), commit="a" * 40)
    add_repo(home, "org/tiny-llama", dir_files(dev_dir), commit="b" * 40, refs=("dev",))
    add_repo(home, "org/smol-gguf", {GGUF_NAME: default_model_path()}, commit="c" * 40, link_blobs=True)
    return {"home": home, "main": main_dir, "dev": dev_dir}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HOME", hub["home"])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_llm_from_hub_id_equals_local_dir(offline):
    from_hub = LLM("org/tiny-llama", **SMALL)
    mc = from_hub.llm_engine.model_config
    assert mc.model.endswith(os.path.join("models--org--tiny-llama", "snapshots", "a" * 40))
    assert mc.served_model_name == "org/tiny-llama"
    assert from_hub.get_tokenizer().encode("Hello world") == LLM(offline["main"], **SMALL).get_tokenizer().encode(
        "Hello world")
    assert tokens(from_hub) == tokens(LLM(offline["main"], **SMALL))


def test_revision_branch_and_commit(offline):
    dev = LLM("org/tiny-llama", revision="dev", **SMALL)
    assert dev.llm_engine.model_config.model.endswith("b" * 40)
    assert tokens(dev) == tokens(LLM(offline["dev"], **SMALL))
    by_commit = EngineArgs(model="org/tiny-llama", revision="b" * 40, **SMALL).create_engine_config()
    assert by_commit.model_config.model.endswith("b" * 40)
    # the tokenizer from another revision (a tokenizer-only lookup)
    cfg = EngineArgs(model="org/tiny-llama", tokenizer_revision="dev", **SMALL).create_engine_config()
    assert cfg.model_config.model.endswith("a" * 40) and cfg.model_config.tokenizer.endswith("b" * 40)


def test_download_dir_hub_cache_env_and_tokenizer_id(offline, monkeypatch, tmp_path):
    cache = os.path.join(offline["home"], "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty home: only the explicit cache has the model
    cfg = EngineArgs(model="org/tiny-llama", download_dir=cache, **SMALL).create_engine_config()
    assert cfg.model_config.model.startswith(cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    cfg = EngineArgs(model=offline["main"], tokenizer="org/tiny-llama", **SMALL).create_engine_config()
    assert cfg.model_config.model == offline["main"] and cfg.model_config.tokenizer.startswith(cache)


def test_missing_id_is_one_clear_line(offline):
    with pytest.raises(ValueError) as e:
        LLM("org/no-such-model", **SMALL)
    msg = str(e.value)
    assert "\n" not in msg and "'org/no-such-model'" in msg
    assert os.path.join(offline["home"], "hub") in msg and "HF_HUB_OFFLINE=1" in msg
    with pytest.raises(ValueError, match="revision 'nope'"):
        EngineArgs(model="org/tiny-llama", revision="nope", **SMALL).create_engine_config()
    with pytest.raises(ValueError, match="not a local directory or .gguf file, nor a hub id"):
        EngineArgs(model="/no/such/dir").create_engine_config()


def test_gguf_repo_needs_its_file(offline):
    with pytest.raises(ValueError, match=rf"GGUF repo; name the file as org/smol-gguf:FILE.gguf .*{GGUF_NAME}"):
        EngineArgs(model="org/smol-gguf").create_engine_config()
    mc = EngineArgs(model=f"org/smol-gguf:{GGUF_NAME}", load_format="dummy", **SMALL).create_engine_config().model_config
    assert mc.load_format == "dummy" and mc.gguf_file == GGUF_NAME and mc.model.endswith(GGUF_NAME)
    assert mc.architecture == "LlamaForCausalLM" and mc.hf_config.num_hidden_layers == 30
    assert mc.served_model_name == f"org/smol-gguf:{GGUF_NAME}"
    # --gguf-file names the same file (resolution only: the config read above takes seconds)
    assert resolve_model("org/smol-gguf", gguf_file=GGUF_NAME).path == mc.model
    with pytest.raises(ValueError, match="two different GGUF files"):
        resolve_model(f"org/smol-gguf:{GGUF_NAME}", gguf_file="other.gguf")


def test_clean_local_names():
    assert local_model_name(default_model_path()) == "SmolLM2-135M-Instruct"
    assert local_model_name("/m/Qwen3-0.6B-Q4_K_M.gguf") == "Qwen3-0.6B"
    assert local_model_name("/models/llama-2-13b/") == "llama-2-13b"
