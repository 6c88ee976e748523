"""The embedded SmolLM2 GGUF executed in its blocks (quantization/gguf.py), the default on the
CPU, against the same file dequantized to float32 (`quantization="none"`, the old path)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import gguf_kernels

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="no C compiler for the GGUF kernels")

TEXT = ("The city of Paris lies on the Seine in the north of France. It has been the country's capital for "
        "most of its history, and its museums, such as the Louvre, hold some of the best known paintings in "
        "the world. Every year millions of visitors walk along its boulevards, climb the Eiffel Tower and eat "
        "in its small restaurants, where the bread is baked fresh each morning.")


@pytest.fixture(scope="module")
def quantized():
    return LLM(kv_cache_memory="64MiB", max_model_len=1024)


@pytest.fixture(scope="module")
def dequantized():
    return LLM(kv_cache_memory="64MiB", max_model_len=1024, quantization="none")


def _weights(llm):
    return llm.llm_engine.executor.worker.model


def test_blocks_are_kept_and_the_head_is_tied(quantized, dequantized):
    model = _weights(quantized)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.quant_method.describe() == "gguf Q4_1"
    assert qkv.weight.shape == (576 + 2 * 192, 576 // 32 * 20)
    # the tied LM head multiplies by the embedding's own Q8_0 blocks: one copy of the vocabulary
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.uint8 and model.lm_head.quant_method.describe() == "gguf Q8_0"
    ours = quantized.llm_engine.executor.worker.weight_bytes
    old = dequantized.llm_engine.executor.worker.weight_bytes
    assert ours < 0.2 * old, (ours, old)
    assert quantized.llm_engine.executor.worker.precision["weights"] == "gguf Q4_1 (CPU kernels)"
    assert quantized.llm_engine.executor.worker.precision["lm_head"] == "gguf Q8_0"
    assert _weights(dequantized).lm_head.weight.dtype == torch.float32


def test_capital_of_france(quantized):
    out = quantized.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def _top1(llm, ids):
    """The top-1 token the model predicts after each prefix of `ids` (teacher-forced)."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return [max(d.items(), key=lambda kv: kv[1].logprob)[0] for d in out.prompt_logprobs[1:]]


def test_teacher_forced_top1_agrees_with_float32(quantized, dequantized):
    ids = quantized.get_tokenizer()(TEXT)["input_ids"]
    a, b = _top1(quantized, ids), _top1(dequantized, ids)
    assert len(a) == len(ids) - 1
    agree = sum(x == y for x, y in zip(a, b)) / len(a)
    assert agree >= 0.97, agree


def test_embedding_rows_are_the_dequantized_rows(quantized, dequantized):
    ids = torch.tensor([0, 17, 49151, 17])
    ours = _weights(quantized).model.embed_tokens(ids)
    ref = _weights(dequantized).model.embed_tokens(ids)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_quantization_choices_are_checked():
    from pagedllm.config import default_model_path
    from pagedllm.model.layers.quantization import get_quantization_config

    with pytest.raises(ValueError, match="quantization='gguf' runs on the CPU only"):
        get_quantization_config("gguf", None, "gguf", default_model_path(), "cuda", "float16")
    with pytest.raises(ValueError, match="quantization='gguf' runs float32 activations"):
        get_quantization_config("gguf", None, "gguf", default_model_path(), "cpu", "bfloat16")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model"):
        get_quantization_config("gguf", None, "safetensors", "/x", "cpu", "float32")
    # auto on a GPU or in another dtype: dequantized at load, as before
    assert get_quantization_config(None, None, "gguf", default_model_path(), "cuda", "float16") is None
    assert get_quantization_config(None, None, "gguf", default_model_path(), "cpu", "bfloat16") is None


def test_tensor_parallel_splits_the_blocks(quantized):
    """tp=3 (SmolLM2's 9 heads, 3 kv heads): each rank holds its rows (column-parallel) or its
    whole blocks of K (row-parallel: o_proj's 192 and down_proj's 512 columns a rank are whole
    Q4_1 blocks) and its third of the vocabulary; the greedy tokens are tp=1's."""
    prompt = quantized.get_tokenizer()("The capital of France is")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=12)
    tp2 = LLM(kv_cache_memory="32MiB", max_model_len=256, tensor_parallel_size=3)
    try:
        ours = tp2.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        tp2.llm_engine.shutdown()
    assert ours == quantized.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
