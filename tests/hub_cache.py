"""A real Hugging Face hub cache layout, built offline for tests (our machines have no hub):

    HF_HOME/hub/models--org--name/
        blobs/<sha256>                      the files' contents
        snapshots/<commit>/<file>  ->  ../../blobs/<sha256>
        refs/main                           <commit>

exactly what `huggingface_hub` writes when it downloads, so its offline lookup (and ours) runs
unchanged against it."""

from __future__ import annotations

import hashlib
import os
import shutil


def add_repo(hf_home: str, repo_id: str, files: dict[str, str], *, commit: str | None = None,
             refs: tuple[str, ...] = ("main",), link_blobs: bool = False) -> str:
    """Caches `files` (name in the repo -> local source path) as `repo_id` at `commit`, with the
    branches `refs` pointing at it. link_blobs: a blob is a symlink to its source (for big files).
    Returns the snapshot directory."""
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    repo_dir = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo_dir, "snapshots", commit)
    os.makedirs(os.path.join(repo_dir, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    for name, src in files.items():
        if link_blobs:  # a big file: named by where it is, not read
            digest = hashlib.sha256(f"{os.path.abspath(src)}:{os.path.getsize(src)}".encode()).hexdigest()
        else:
            with open(src, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        blob = os.path.join(repo_dir, "blobs", digest)
        if not os.path.exists(blob):
            if link_blobs:
                os.symlink(os.path.abspath(src), blob)
            else:
                shutil.copyfile(src, blob)
        dst = os.path.join(snap, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(dst)), dst)
    for ref in refs:
        with open(os.path.join(repo_dir, "refs", ref), "w") as f:
            f.write(commit)
    return snap


def dir_files(path: str) -> dict[str, str]:
    return {name: os.path.join(path, name) for name in os.listdir(path) if os.path.isfile(os.path.join(path, name))}


def resave_with_seed(src_dir: str, out_dir: str, seed: int, **config_changes) -> str:
    """The model of `src_dir` (config, tokenizer files) with fresh random weights from `seed`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(src_dir)
    for key, value in config_changes.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().save_pretrained(out_dir)
    for name in os.listdir(src_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(src_dir, name), out_dir)
    return out_dir
