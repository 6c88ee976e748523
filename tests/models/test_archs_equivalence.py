"""Gemma 2, Gemma 3, Phi-3 and the sliding-window / rope-scaling variants of Mistral, Qwen2 and
Llama: greedy token ids equal transformers' generate exactly in float32 on CPU for one prompt,
8 prompts at once (longer than the budget: chunked prefill; longer than the window), prefix-
cache hits and preemption; logprobs within 1e-4 of HF's log-softmax. Every norm weight is
randomized too (HF initializes Gemma's to 0, which would hide a wrong (1 + w)).

The rope types: YaRN (Qwen2, past its original context of 64), LongRoPE (Phi-3, past and
within its original 64, the last test), linear (Llama; Gemma 3's global layers), dynamic NTK
(Llama, within its original context, where HF's per-length base is the plain one); llama3 is
in test_hf_equivalence.py. Published configs of these families: test_held_out_configs.py."""

from __future__ import annotations

import pytest
import torch

from tiny_models import VOCAB, copy_tokenizer
from pagedllm import LLM, SamplingParams
from test_hf_equivalence import _bytes_for_blocks, check, hf_greedy, prompts_of

WINDOW = 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=2)


def _config(name: str):
    import transformers as tf

    if name == "gemma2":  # sliding, global, sliding; both soft caps small enough to bite
        return tf.Gemma2Config(**COMMON, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
                               sliding_window=WINDOW, attn_logit_softcapping=3.0, final_logit_softcapping=4.0, tie_word_embeddings=False)
    if name == "gemma3":  # two local layers, one global; local and global rope bases
        return tf.Gemma3TextConfig(**COMMON, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=False,
                                   sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1000000.0}})
    if name == "phi3":
        return tf.Phi3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    if name == "phi3-longrope-window":  # LongRoPE with an original context of 64, and a window
        half = 8
        return tf.Phi3Config(**dict(COMMON, max_position_embeddings=512), num_hidden_layers=2, sliding_window=24,
                             original_max_position_embeddings=64,
                             rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(half)],
                                           "long_factor": [1.5 + i for i in range(half)]})
    if name == "mistral-window":
        return tf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW)
    if name == "qwen2-window-yarn":  # layer 0 global, layer 1 sliding; YaRN from an original 64
        return tf.Qwen2Config(**dict(COMMON, max_position_embeddings=64), num_hidden_layers=2, use_sliding_window=True,
                              sliding_window=WINDOW, max_window_layers=1,
                              rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    if name == "llama-dynamic":
        return tf.LlamaConfig(**COMMON, num_hidden_layers=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    if name == "llama-linear":
        return tf.LlamaConfig(**COMMON, num_hidden_layers=2, rope_scaling={"rope_type": "linear", "factor": 4.0})
    raise ValueError(name)


NAMES = ["gemma2", "gemma3", "phi3", "mistral-window", "qwen2-window-yarn", "llama-dynamic", "llama-linear"]
# every test runs on every model (in CI: each takes about a second once its model is built)
models = pytest.mark.parametrize("model", NAMES, indirect=True)
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=256, block_size=8, max_num_batched_tokens=32)


def save_model(cfg, out_dir: str, tokenizer_dir: str, seed: int = 1) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in cfg.model_type else 1.0))
    model.save_pretrained(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model(request, tmp_path_factory, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    path = save_model(_config(request.param), str(tmp_path_factory.mktemp(request.param)), tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, LLM(path, **ENGINE)


@models
def test_single_prompt(model):
    path, hf, llm = model
    check(llm, hf, prompts_of([23]))
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@models
def test_eight_prompts_chunked_and_past_the_window(model):
    """Lengths up to 100 tokens: past the 16-token window, past the 32-token budget (chunked
    prefill), past LongRoPE's / YaRN's original context of 64."""
    path, hf, llm = model
    check(llm, hf, prompts_of([1, 5, 17, 33, 64, 100, 2, 70], seed=1))


@models
def test_prefix_cache_hits(model):
    path, hf, llm = model
    shared = prompts_of([45], seed=3)[0]
    tails = prompts_of([3, 11, 20, 1], seed=4)
    before = llm.llm_engine.get_stats().prefix_cache_hits
    check(llm, hf, [shared + tails[0]])
    check(llm, hf, [shared + t for t in tails[1:]])
    assert llm.llm_engine.get_stats().prefix_cache_hits - before >= 3 * 40


@models
def test_preemption(model):
    path, hf, _ = model
    llm = LLM(path, block_size=4, max_model_len=96, max_num_seqs=8, kv_cache_memory=_bytes_for_blocks(path, 4, 40))
    check(llm, hf, prompts_of([20, 33, 9, 27, 14, 30, 5, 24], seed=5))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == 40


@models
def test_logprobs_match_hf(model):
    path, hf, llm = model
    prompt = prompts_of([70], seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.token_ids == hf_greedy(hf, prompt, 6)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + comp.token_ids])).logits[0].float(), dim=-1)
    for j, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + j]
        top = row.topk(5)
        for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(lps[tid].logprob - lp) < 1e-4
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4


def test_longrope_past_and_within_the_original_context(tmp_path, tokenizer_dir):
    """Phi-3 LongRoPE with an original context of 64 (and a 24-token window): served past it
    (max_model_len 256) every prompt longer than 64 tokens equals HF (which then uses the long
    factors throughout), in one batch with chunked prefill and prefix hits; served within it
    (max_model_len 64) short prompts equal HF's short factors."""
    from transformers import AutoModelForCausalLM

    path = save_model(_config("phi3-longrope-window"), str(tmp_path), tokenizer_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, **ENGINE)
    shared = prompts_of([70], seed=3)[0]
    check(llm, hf, prompts_of([65, 100, 81, 130], seed=1) + [shared + t for t in prompts_of([3, 11], seed=4)])
    check(llm, hf, [shared + t for t in prompts_of([20, 1], seed=5)])
    assert llm.llm_engine.get_stats().prefix_cache_hits >= 2 * 64
    short = LLM(path, **dict(ENGINE, max_model_len=64))
    check(short, hf, prompts_of([1, 17, 40, 50], seed=2))
