"""The founding document's Python example as written: a plain script, no `if __name__ ==
"__main__":` guard, `LLM(model=..., tensor_parallel_size=2)` then `generate`, gives the tokens of
tensor_parallel_size=1 (the workers are forked); forced to spawn, the same script fails with one
pagedllm line naming the cause and the fix, not multiprocessing's traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42, 7], "Hello, world!"]
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=128)
SCRIPT = textwrap.dedent("""
    import json
    from pagedllm import LLM, SamplingParams
    llm = LLM(model={model!r}, tensor_parallel_size=2, kv_cache_memory="8MiB", max_model_len=128)
    sampling_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate({prompts!r}, sampling_params)
    print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]))
""")


def run_script(tmp_path, model: str, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(SCRIPT.format(model=model, prompts=PROMPTS))
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env)
    full_env.pop("PAGEDLLM_WORKER_MULTIPROC_METHOD", None)
    full_env.update(env)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=full_env, cwd=tmp_path)


def test_no_guard_script_tp2_equals_tp1(tiny_llama, tmp_path):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, **ENGINE).generate(PROMPTS, greedy, use_tqdm=False)]
    out = run_script(tmp_path, tiny_llama)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == expected


@pytest.mark.extended  # 30 s: the spawned worker imports torch and transformers again
def test_spawn_without_guard_is_one_clear_line(tiny_llama, tmp_path):
    out = run_script(tmp_path, tiny_llama, PAGEDLLM_WORKER_MULTIPROC_METHOD="spawn")
    assert out.returncode != 0
    err = out.stderr
    assert err.count("pagedllm: a spawned tensor-parallel worker re-ran the script's top level") == 1, err[-3000:]
    assert "bootstrapping phase" not in err and err.count("Traceback") <= 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "tensor-parallel worker rank 1 failed to start" in last and 'if __name__ == "__main__":' in last, last


def test_start_method_choice(monkeypatch):
    from pagedllm.executor.start_method import worker_start_method

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert worker_start_method() == "fork"
    monkeypatch.setenv("PAGEDLLM_WORKER_MULTIPROC_METHOD", "thread")
    with pytest.raises(ValueError, match="PAGEDLLM_WORKER_MULTIPROC_METHOD must be one of fork, spawn"):
        worker_start_method()
    monkeypatch.delenv("PAGEDLLM_WORKER_MULTIPROC_METHOD")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    assert worker_start_method() == "spawn"  # under pytest (python -m pytest): no script to re-run
