"""The llama.cpp peer of W4 (`throughput.py --peer llama-cpp`): llama-cpp-python on the same
.gguf file, one request at a time as a CPU user runs it, greedy, each request exactly its
max_tokens (EOS not checked), timed inside the peer's process.

It lives in its own venv and runs as a subprocess (this file, run by that venv's python, reads
the requests as JSON on stdin and writes the result as JSON on stdout):

    python3 -m venv ~/.venvs/llama-cpp && ~/.venvs/llama-cpp/bin/pip install llama-cpp-python==0.3.36

`PAGEDLLM_LLAMA_CPP_PYTHON` names another interpreter. `PAGEDLLM_LLAMA_CPP_EXTRA_BUFTS=0` loads
the model without llama.cpp's extra buffer types (its repacked / AMX weight layouts;
`use_extra_bufts` of the model params, llama.cpp's --no-repack): 0.3.36's wheel segfaults in its
first eval with them on an AVX512-VNNI + AMX Xeon (benchmarks/RESULTS.md). The 2026-12-03 16:04
figures used a build without AMX instead, which runs with the default buffers:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=ON" \
      ~/.venvs/llama-cpp/bin/pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36

Parallel sequences are not run: the
high-level `Llama` API decodes one sequence per context (the low-level batch API would need a
sampling loop of our own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DEFAULT_PYTHON = os.path.expanduser("~/.venvs/llama-cpp/bin/python")


def _serve() -> None:
    from llama_cpp import Llama

    req = json.load(sys.stdin)
    if not req.get("extra_bufts", True):
        import llama_cpp
        import llama_cpp.llama

        defaults = llama_cpp.llama_model_default_params

        def params():
            p = defaults()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    llm = Llama(model_path=req["model"], n_ctx=req["n_ctx"], n_threads=req["threads"], n_batch=512, verbose=False,
                seed=0)

    def run(prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out

    for prompt in req["warmup"]:
        run(prompt, 4)
    t0, c0 = time.perf_counter(), time.process_time()
    outputs = [run(p, n) for p, n in zip(req["prompts"], req["max_tokens"])]
    json.dump({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "outputs": outputs},
              sys.stdout)


def run_llama_cpp(model: str, prompts: list[list[int]], max_tokens: list[int], threads: int,
                  warmup_prompts: list[list[int]]):
    """One timed pass of the peer over the requests, as a common.PeerResult."""
    import common

    python = os.environ.get("PAGEDLLM_LLAMA_CPP_PYTHON", DEFAULT_PYTHON)
    if not os.path.exists(python):
        raise RuntimeError(f"no llama-cpp-python interpreter at {python} (see benchmarks/llama_cpp_peer.py)")
    n_ctx = max(len(p) + n for p, n in zip(prompts, max_tokens)) + 8
    req = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "threads": threads, "n_ctx": n_ctx,
           "warmup": warmup_prompts,
           "extra_bufts": os.environ.get("PAGEDLLM_LLAMA_CPP_EXTRA_BUFTS", "1") not in ("0", "false", "no", "off")}
    res = subprocess.run([python, os.path.abspath(__file__)], input=json.dumps(req), capture_output=True, text=True,
                         timeout=3600, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"llama-cpp-python failed: {res.stderr.strip()[-2000:]}")
    out = json.loads(res.stdout)
    bufts = "" if req["extra_bufts"] else ", no extra bufts"
    name = f"llama.cpp (llama-cpp-python, sequential, {threads} threads{bufts})"
    return common.PeerResult(name, out["seconds"],
                             sum(max_tokens), sum(max_tokens), out["outputs"], cpu_seconds=out["cpu_seconds"])


if __name__ == "__main__":
    _serve()
