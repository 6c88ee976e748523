"""Hub model ids: `LLM("Qwen/Qwen3-0.6B")` and `pagedllm serve org/name` resolve the id to a local
directory (or, for a GGUF repo, a local .gguf file) with `huggingface_hub`, as vLLM does:

- the local cache first: `download_dir`, else `$HF_HUB_CACHE`, else `$HF_HOME/hub` (read when the
  engine is built, not when huggingface_hub was imported), at `revision` (a branch or tag through
  `refs/`, or a commit);
- then a download into that cache when the machine is online; `HF_HUB_OFFLINE=1` means none;
- the token is `hf_token`, else `$HF_TOKEN` / the stored login (huggingface_hub's own lookup);
- a GGUF repo needs the file name: `org/name:FILE.gguf` or `gguf_file="FILE.gguf"`.

A local path always wins over a hub id of the same spelling. Only weights, configs and tokenizer
files are fetched (`ALLOW_PATTERNS`); pickled checkpoints never are. A missing id is one
ValueError line naming the id, the cache searched and whether the machine was offline.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*", "*.tiktoken"]
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "tokenizer*", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GGUF_QUANT = re.compile(r"[.-](I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # a local directory or .gguf file
    name: str  # the served name by default: the id as given, or a clean local name
    repo_id: str | None = None  # set when it came from the hub


def hub_cache_dir(download_dir: str | None = None) -> str:
    if download_dir:
        return os.path.expanduser(download_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def local_model_name(path: str) -> str:
    """A clean name for a local model: the directory's name, or a GGUF file's without its
    extension and quantization suffix (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct)."""
    base = os.path.basename(os.path.abspath(path).rstrip("/"))
    if base.endswith(".gguf"):
        base = _GGUF_QUANT.sub("", base[: -len(".gguf")])
    return base


def split_gguf_spec(model: str, gguf_file: str | None) -> tuple[str, str | None]:
    """`org/name:FILE.gguf` -> ("org/name", "FILE.gguf"); otherwise (model, gguf_file)."""
    repo, sep, file = model.rpartition(":")
    if sep and repo and file.endswith(".gguf") and not os.path.exists(model):
        if gguf_file is not None and gguf_file != file:
            raise ValueError(f"gguf_file={gguf_file!r} and model {model!r} name two different GGUF files")
        return repo, file
    return model, gguf_file


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.startswith((".", "~"))


def resolve_model(model: str, *, revision: str | None = None, download_dir: str | None = None,
                  token: str | bool | None = None, gguf_file: str | None = None) -> ResolvedModel:
    """A local path as given (with `gguf_file` joined to a directory), else the hub id resolved."""
    repo, gguf_file = split_gguf_spec(model, gguf_file)
    if os.path.exists(repo):
        path = repo
        if gguf_file is not None and os.path.isdir(repo):
            path = os.path.join(repo, gguf_file)
            if not os.path.isfile(path):
                raise ValueError(f"gguf_file: {gguf_file!r} is not in the directory {repo!r}")
        return ResolvedModel(path, local_model_name(path))
    if not looks_like_repo_id(repo):
        raise ValueError(f"model: {model!r} is not a local directory or .gguf file, nor a hub id (org/name)")
    cache = hub_cache_dir(download_dir)
    if gguf_file is not None:
        path = _fetch(repo, revision, cache, token, filename=gguf_file)
    else:
        path = _fetch(repo, revision, cache, token, patterns=ALLOW_PATTERNS)
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(f for f in _repo_files(repo, revision, cache, token, path) if f.endswith(".gguf"))
            if ggufs:
                shown = ", ".join(ggufs[:6]) + (" ..." if len(ggufs) > 6 else "")
                raise ValueError(f"model: {repo!r} is a GGUF repo; name the file as {repo}:FILE.gguf or with "
                                 f"gguf_file / --gguf-file (its files: {shown})")
            raise ValueError(f"model: the hub repo {repo!r} has no config.json (in {path})")
    return ResolvedModel(path, model, repo)


def resolve_tokenizer(tokenizer: str, *, revision: str | None, download_dir: str | None,
                      token: str | bool | None) -> str:
    """A local tokenizer path as given, else its hub id resolved (tokenizer files only)."""
    if os.path.exists(tokenizer) or not looks_like_repo_id(tokenizer):
        return tokenizer
    return _fetch(tokenizer, revision, hub_cache_dir(download_dir), token, patterns=TOKENIZER_PATTERNS)


def _fetch(repo: str, revision: str | None, cache: str, token: str | bool | None, *,
           filename: str | None = None, patterns: list[str] | None = None) -> str:
    """The cached snapshot (or file) of `repo`; downloaded when it is not cached and we are online."""
    from huggingface_hub import hf_hub_download, snapshot_download

    def get(local_only: bool) -> str:
        common = dict(revision=revision, cache_dir=cache, token=token, local_files_only=local_only)
        if filename is not None:
            return hf_hub_download(repo, filename, **common)
        return snapshot_download(repo, allow_patterns=patterns, **common)

    what = repr(repo) + (f" file {filename!r}" if filename else "") + (f" at revision {revision!r}" if revision else "")
    try:
        path = get(True)
        if filename is not None or _has_weights(path) or hub_offline():
            return path
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises several kinds for "not cached"
        if hub_offline():
            raise ValueError(f"model: {what} is not a local path and is not in the Hugging Face cache {cache}; "
                             "HF_HUB_OFFLINE=1, so no download was tried") from None
        cached_error = e
    else:
        cached_error = None
    try:
        return get(False)
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one line for each
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
        raise ValueError(f"model: {what} is not a local path, not in the Hugging Face cache {cache}, and the "
                         f"download failed ({reason})") from (cached_error or e)


def _has_weights(path: str) -> bool:
    """A snapshot that holds a config but no weights was cached by a config-only fetch."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return any(f.endswith(".safetensors") for f in os.listdir(path))


def _repo_files(repo: str, revision: str | None, cache: str, token: str | bool | None, local: str) -> list[str]:
    """File names of the repo: from the hub when online, else those of the cached snapshot."""
    names: list[str] = []
    snapshot_root = os.path.dirname(local)
    for root in {local, *(os.path.join(snapshot_root, d) for d in os.listdir(snapshot_root))}:
        if os.path.isdir(root):
            names += os.listdir(root)
    if not hub_offline():
        try:
            from huggingface_hub import list_repo_files

            names += list_repo_files(repo, revision=revision, token=token)
        except Exception:  # noqa: BLE001 - offline in practice: the cached names are what we have
            pass
    return sorted(set(names))
