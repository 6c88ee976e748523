"""Long contexts on the GPU (issue: the GPU path, item 6): Llama-3.1-8B with random weights,
(a) a 4,096-token prompt followed by 4,096 generated tokens, (b) a 32,768-token prompt (chunked
prefill) followed by 128 tokens. Prints the times and checks every token was produced.

    python benchmarks/long_context.py [--model benchmarks/configs/llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from pagedllm import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=os.path.join(HERE, "configs", "llama-3.1-8b"))
    p.add_argument("--max-model-len", type=int, default=40960)
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=args.max_model_len, max_num_seqs=16)
    print(f"startup {time.perf_counter() - t0:.1f}s")
    rng = random.Random(0)
    cases = [("4096 in / 4096 out", 4096, 4096), ("32768 in / 128 out", 32768, 128)]
    for name, n_in, n_out in cases:
        prompt = [rng.randrange(0, 10000) for _ in range(n_in)]
        t = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True), use_tqdm=False)[0]
        dt = time.perf_counter() - t
        m = out.metrics
        got = len(out.outputs[0].token_ids)
        ttft = m.first_token_time - m.arrival_time
        decode = (m.last_token_time - m.first_token_time) / max(got - 1, 1) * 1000
        status = "ok" if got == n_out else f"FAILED ({got} tokens)"
        print(f"{name}: {status}; total {dt:.2f}s, TTFT {ttft * 1000:.0f} ms, decode {decode:.2f} ms/token")


if __name__ == "__main__":
    main()
