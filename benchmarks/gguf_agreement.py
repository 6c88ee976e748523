"""Teacher-forced top-1 agreement of a GGUF model executed in its blocks (quantization=gguf, the
CPU default) with the same file dequantized to float32 (quantization=none): both read the same
English text (Python's own documentation, pydoc_data.topics, cut into chunks), and at every
position each predicts its most likely next token; the figure is the share of positions where
the two agree.

    python benchmarks/gguf_agreement.py --tokens 4000
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def english_chunks(tokenizer, total: int, chunk: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text)["input_ids"][:total]
    return [ids[i:i + chunk] for i in range(0, len(ids), chunk) if len(ids[i:i + chunk]) > 1]


def top1(llm, chunks: list[list[int]]) -> list[list[int]]:
    from pagedllm import SamplingParams

    outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return [[max(d.items(), key=lambda kv: kv[1].logprob)[0] for d in o.prompt_logprobs[1:]] for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--chunk", type=int, default=500, help="tokens per prompt")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    common.set_threads(None)
    from pagedllm import LLM
    from pagedllm.config import default_model_path

    model = args.model or default_model_path()
    kw = dict(kv_cache_memory="256MiB", max_model_len=max(args.chunk + 8, 512))
    quantized = LLM(model, **kw)
    chunks = english_chunks(quantized.get_tokenizer(), args.tokens, args.chunk)
    ours = top1(quantized, chunks)
    weights = quantized.llm_engine.executor.worker.precision["weights"]
    del quantized
    common.release_memory()
    ref = top1(LLM(model, quantization="none", **kw), chunks)
    positions = sum(len(a) for a in ours)
    same = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b))
    print(f"{os.path.basename(model)}: {weights} vs float32 (dequantized): top-1 agreement "
          f"{same}/{positions} = {100 * same / positions:.2f}% over {len(chunks)} chunks of <= {args.chunk} tokens")
    common.print_machine_line(common.machine_info())
    common.write_json(args.output_json, {"model": model, "weights": weights, "positions": positions, "agree": same})


if __name__ == "__main__":
    main()
