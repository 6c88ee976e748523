"""FP8 accuracy on the real model (the embedded SmolLM2-135M-Instruct, on the CPU): FP8 weights
(online, per-channel) + an FP8 e4m3 KV cache against the float32 reference, teacher-forced
over the repository's README (English prose and code, about 3,000 tokens): top-1 agreement of
the next-token predictions and the mean KL divergence KL(reference || FP8); and the chat answer
to "What is the capital of France?" still contains Paris.

Teacher forcing runs the model itself over chunks of the text with its own paged cache (chunked
prefill: every chunk attends to the FP8 blocks the earlier ones stored), then the last tokens
one at a time (the decode path over the FP8 cache). The whole module is `extended` (minutes on
two shared cores): `pytest -m extended -s tests/models/test_fp8_accuracy.py` prints the figures.
Measured on 2026-12-01 over 600 tokens: 88.67% top-1, KL 0.028 (FP8 weights alone 90.67% /
0.020, FP8 KV alone 94.50% / 0.008), below the issue's 95% target: the thresholds below are
what holds today, not the goal. bfloat16 without FP8 agrees on 95.83% of the same tokens
(benchmarks/RESULTS.md, 2026-12-02: what was tried and why the target leaves FP8 no room here)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import ForwardBatch
from pagedllm.config import EngineArgs
from pagedllm.model.layers.attention import bind_kv_cache
from pagedllm.worker.worker import Worker

pytestmark = pytest.mark.extended

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _batch(ids: list[int], start: int, end: int, nblk: int, decode: bool) -> ForwardBatch:
    q = end - start
    return ForwardBatch(
        input_ids=torch.tensor(ids[start:end]), positions=torch.arange(start, end),
        slot_mapping=torch.arange(start, end),  # block table = 0, 1, 2 ...: slot = position
        query_start_loc=torch.tensor([0, q], dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.arange(nblk, dtype=torch.int32)[None], logits_indices=torch.arange(q),
        num_decodes=1 if decode else 0, max_query_len=q, max_seq_len=end, query_lens_cpu=[q], seq_lens_cpu=[end],
    )


@torch.inference_mode()
def teacher_forced_logits(ids: list[int], chunk: int = 512, decodes: int = 16, k_offsets: bool = False,
                          **engine_kw) -> torch.Tensor:  # fmt: skip
    """[len(ids), vocab] float32 logits of the embedded model over `ids`; k_offsets: an FP8 cache's
    keys stored less their offsets, calibrated as the engine's startup does (worker/kv_offset.py)."""
    from pagedllm.worker.kv_offset import calibrate_k_offsets

    config = EngineArgs(max_model_len=4096, **engine_kw).create_engine_config()
    worker = Worker(config)
    mc, bs = config.model_config, config.cache_config.block_size
    nblk = max(-(-len(ids) // bs), -(-512 // bs))
    cache = torch.zeros((mc.num_layers, 2, nblk, bs, worker.num_kv_heads, mc.head_dim), dtype=worker.kv_dtype)
    bind_kv_cache(worker.model, [cache[i, 0] for i in range(mc.num_layers)],
                  [cache[i, 1] for i in range(mc.num_layers)], worker.backend)
    if k_offsets:
        assert calibrate_k_offsets(worker.model, mc.vocab_size, nblk, bs, mc.max_model_len, worker.device) > 0
    bounds = list(range(0, len(ids) - decodes, chunk)) + list(range(len(ids) - decodes, len(ids) + 1))
    out = []
    for start, end in zip(bounds, bounds[1:]):
        batch = _batch(ids, start, end, nblk, decode=end - start == 1)
        hidden = worker.model(batch.input_ids, batch.positions, batch)
        out.append(worker.model.compute_logits(hidden).float())
    return torch.cat(out)


def agreement_and_kl(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).mean().item()
    return top1, kl


def _text_ids(n: int) -> list[int]:
    from pagedllm.config import default_model_path
    from transformers import AutoTokenizer

    d, f = os.path.split(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    with open(README) as fh:
        ids = tokenizer(fh.read())["input_ids"]
    return ids[:n]


def _measure(n: int) -> dict[str, tuple[float, float]]:
    ids = _text_ids(n)
    ref = teacher_forced_logits(ids)
    rows = {}
    for name, kw in (("fp8 weights + fp8 kv", dict(quantization="fp8", kv_cache_dtype="fp8")),
                     ("fp8 weights", dict(quantization="fp8")), ("fp8 kv", dict(kv_cache_dtype="fp8"))):
        rows[name] = agreement_and_kl(ref, teacher_forced_logits(ids, **kw))
    print(f"\nSmolLM2-135M-Instruct, {len(ids)} teacher-forced tokens of README.md, against float32:")
    for name, (top1, kl) in rows.items():
        print(f"  {name:22s} top-1 agreement {100 * top1:6.2f}%  mean KL {kl:.5f} nats")
    return rows


def test_fp8_accuracy_teacher_forced():
    top1, kl = _measure(600)["fp8 weights + fp8 kv"]
    assert top1 >= 0.85 and math.isfinite(kl) and kl < 0.05


def test_fp8_kv_offsets_cut_the_kl():
    """An FP8 cache storing keys less their calibrated offsets (PAGEDLLM_FP8_KV_OFFSET) against the
    same cache storing them as they are: a lower KL to float32 on the README, and no lower top-1.
    Measured on these 600 tokens: top-1 93.17% -> 94.67%, KL 0.00849 -> 0.00804 nats (on 3,000
    tokens of Python's documentation, benchmarks/fp8_kv_offset.py: 92.83% -> 94.03%, KL 0.01797 ->
    0.01249)."""
    ids = _text_ids(600)
    ref = teacher_forced_logits(ids)
    plain = agreement_and_kl(ref, teacher_forced_logits(ids, kv_cache_dtype="fp8"))
    offset = agreement_and_kl(ref, teacher_forced_logits(ids, kv_cache_dtype="fp8", k_offsets=True))
    print(f"\nFP8 KV, 600 README tokens: top-1 {plain[0]:.4f} -> {offset[0]:.4f}, KL {plain[1]:.5f} -> {offset[1]:.5f}")
    assert offset[1] < plain[1] and offset[0] >= plain[0]


def test_capital_of_france_with_fp8_weights_and_kv():
    llm = LLM(kv_cache_memory="64MiB", max_model_len=1024, quantization="fp8", kv_cache_dtype="fp8")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
