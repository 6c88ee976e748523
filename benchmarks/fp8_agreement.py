"""FP8 accuracy on the embedded SmolLM2-135M-Instruct (CPU): teacher-forced top-1 agreement and
mean KL(float32 || variant) of FP8 weights + FP8 KV, FP8 weights alone, FP8 KV alone and
bfloat16, against the float32 model, over English text: Python's own documentation
(pydoc_data.topics, as benchmarks/gguf_agreement.py reads it) or the repository's README
(tests/models/test_fp8_accuracy.py's text). The teacher forcing is that test's (chunked prefill
over the model's own paged cache, the last tokens one at a time).

    python benchmarks/fp8_agreement.py --text pydoc --tokens 3000
    python benchmarks/fp8_agreement.py --margins 0.5 1 2    # agreement by float32's top-1 lead too
    python benchmarks/fp8_agreement.py --text /usr/share/common-licenses/GPL-3   # any text file

--margins: the same agreement over the positions where float32's top-1 logit leads its second by
at least each margin (nats), and the share of positions that leaves: whether the variant's
disagreements are the float32 model's near-ties.
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
        with open(README if text == "readme" else text) as fh:
            raw = fh.read()
    return tokenizer(raw)["input_ids"][:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default="pydoc", help="pydoc, readme, or the path of a text file")
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--margins", type=float, nargs="*", default=[],
                   help="also the agreement where float32's top-1 leads its second by >= each margin (nats)")
    args = p.parse_args()
    ids = text_ids(args.text, args.tokens)
    ref = teacher_forced_logits(ids, dtype="float32")
    print(f"SmolLM2-135M-Instruct, {len(ids)} teacher-forced tokens of {os.path.basename(args.text)}, against float32:",
          flush=True)
    two = ref.float().topk(2, dim=-1).values
    lead = two[:, 0] - two[:, 1]  # float32's top-1 logit over its second
    for name in args.variants:
        got = teacher_forced_logits(ids, **VARIANTS[name])
        top1, kl = agreement_and_kl(ref, got)
        print(f"  {name:22s} top-1 agreement {100 * top1:6.2f}%  mean KL {kl:.5f} nats", flush=True)
        same = ref.argmax(-1) == got.argmax(-1)
        for margin in args.margins:
            keep = lead >= margin
            share = keep.float().mean().item()
            agree = same[keep].float().mean().item() if keep.any() else float("nan")
            print(f"    where float32 leads by >= {margin:g} nats ({100 * share:5.1f}% of positions): "
                  f"{100 * agree:6.2f}%", flush=True)


if __name__ == "__main__":
    main()
