"""FP8 accuracy on the embedded SmolLM2-135M-Instruct (CPU): teacher-forced top-1 agreement and
mean KL(float32 || variant) of FP8 weights + FP8 KV, FP8 weights alone, FP8 KV alone and
bfloat16, against the float32 model, over English text: Python's own documentation
(pydoc_data.topics, as benchmarks/gguf_agreement.py reads it) or the repository's README
(tests/models/test_fp8_accuracy.py's text). The teacher forcing is that test's (chunked prefill
over the model's own paged cache, the last tokens one at a time).

    python benchmarks/fp8_agreement.py --text pydoc --tokens 3000
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "models"))
from test_fp8_accuracy import README, agreement_and_kl, teacher_forced_logits  # noqa: E402

VARIANTS = {
    "fp8 weights + fp8 kv": dict(quantization="fp8", kv_cache_dtype="fp8"),
    "fp8 weights": dict(quantization="fp8"),
    "fp8 kv": dict(kv_cache_dtype="fp8"),
    "bfloat16": dict(dtype="bfloat16"),
}


def text_ids(text: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from pagedllm.config import default_model_path

    d, f = os.path.split(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    if text == "pydoc":
        from pydoc_data.topics import topics

        raw = "\n\n".join(topics[k] for k in sorted(topics))
    else:
        with open(README) as fh:
            raw = fh.read()
    return tokenizer(raw)["input_ids"][:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", choices=("pydoc", "readme"), default="pydoc")
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    ids = text_ids(args.text, args.tokens)
    ref = teacher_forced_logits(ids, dtype="float32")
    print(f"SmolLM2-135M-Instruct, {len(ids)} teacher-forced tokens of {args.text}, against float32:", flush=True)
    for name in args.variants:
        top1, kl = agreement_and_kl(ref, teacher_forced_logits(ids, **VARIANTS[name]))
        print(f"  {name:22s} top-1 agreement {100 * top1:6.2f}%  mean KL {kl:.5f} nats", flush=True)


if __name__ == "__main__":
    main()
