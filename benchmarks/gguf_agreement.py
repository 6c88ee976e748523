"""Teacher-forced top-1 agreement of a GGUF model executed in its blocks (quantization=gguf, the
CPU default) with the same file dequantized to float32 (quantization=none): both read the same
English text (Python's own documentation, pydoc_data.topics, cut into chunks), and at every
position each predicts its most likely next token; the figure is the share of positions where
the two agree. Beside it, an approximate KL(float32 || ours) per position over the float32
path's top 20 tokens (a token outside ours' top 20 takes ours' 20th logprob; the tail past 20
is left out). PAGEDLLM_GGUF_INT8=0 measures the float-activation kernel instead of the default
int8 one (Q4_0 / Q4_1 / Q8_0). The prompts' prefill is what is measured, so the layers' row
limits (past which a product dequantizes the weight and uses MKL) are lifted here: every
product runs the kernel a decode step runs (--mkl-prefill keeps the engine's limits).

    python benchmarks/gguf_agreement.py --tokens 4000
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def english_chunks(tokenizer, total: int, chunk: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"][:total]
    return [ids[i:i + chunk] for i in range(0, len(ids), chunk) if len(ids[i:i + chunk]) > 1]


TOP = 20


def top_logprobs(llm, chunks: list[list[int]]) -> list[list[dict[int, float]]]:
    """Per chunk, per position after the first: {token: logprob} of the TOP most likely (and
    the text's own token)."""
    from pagedllm import SamplingParams

    outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=TOP), use_tqdm=False)
    return [[{t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs[1:]] for o in outs]


def kl_top(ref: dict[int, float], ours: dict[int, float]) -> float:
    floor = min(ours.values())
    return sum(math.exp(lp) * (lp - ours.get(t, floor)) for t, lp in ref.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--chunk", type=int, default=500, help="tokens per prompt")
    p.add_argument("--mkl-prefill", action="store_true",
                   help="keep the engine's row limits (prefill products through dequantize + MKL)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    common.set_threads(None)
    from pagedllm import LLM
    from pagedllm.config import default_model_path

    if not args.mkl_prefill:
        from pagedllm.model.layers.quantization import gguf

        gguf.PREFILL_ROWS = gguf.INT8_PREFILL_ROWS = 1 << 30
    model = args.model or default_model_path()
    kw = dict(kv_cache_memory="256MiB", max_model_len=max(args.chunk + 8, 512))
    quantized = LLM(model, **kw)
    chunks = english_chunks(quantized.get_tokenizer(), args.tokens, args.chunk)
    ours = top_logprobs(quantized, chunks)
    weights = quantized.llm_engine.executor.worker.precision["weights"]
    del quantized
    common.release_memory()
    ref = top_logprobs(LLM(model, quantization="none", **kw), chunks)
    pairs = [(r, o) for a, b in zip(ref, ours) for r, o in zip(a, b)]
    positions = len(pairs)
    same = sum(max(r, key=r.get) == max(o, key=o.get) for r, o in pairs)
    kl = sum(kl_top(r, o) for r, o in pairs) / positions
    int8 = os.environ.get("PAGEDLLM_GGUF_INT8", "1")
    print(f"{os.path.basename(model)}: {weights} (PAGEDLLM_GGUF_INT8={int8}) vs float32 (dequantized): top-1 "
          f"agreement {same}/{positions} = {100 * same / positions:.2f}%, mean KL (top {TOP}) {kl:.5f} nats, "
          f"over {len(chunks)} chunks of <= {args.chunk} tokens"
          f"{' (prefill through MKL past the row limits)' if args.mkl_prefill else ' (every product in the kernel)'}")
    common.print_machine_line(common.machine_info())
    common.write_json(args.output_json, {"model": model, "weights": weights, "int8": int8, "positions": positions,
                                         "agree": same, "kl_top": kl,
                                         "mkl_prefill": args.mkl_prefill})


if __name__ == "__main__":
    main()
