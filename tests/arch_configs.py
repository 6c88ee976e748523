"""Tiny configs of the OLMo 2, GLM-4, Granite, StarCoder2, GPT-2 and GPT-NeoX families for the
tests (tests/models/test_more_architectures.py, tests/distributed/test_more_architectures_tp.py),
each with its family's own features switched on and initializer_range 0.3 so tokens vary."""

from __future__ import annotations

from tiny_models import VOCAB

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def arch_config(name: str):
    """A tiny config of each family, with the family's own features switched on."""
    import transformers as T

    c = dict(_COMMON)
    if name == "olmo2":
        return T.Olmo2Config(num_key_value_heads=2, **c)
    if name == "glm4":  # partial (0.5) interleaved rotary, q/k/v biases, fused gate_up in the checkpoint
        return T.Glm4Config(num_key_value_heads=2, head_dim=16, attention_bias=True, **c)
    if name == "granite":  # the four multipliers away from 1, tied embeddings, MQA
        return T.GraniteConfig(num_key_value_heads=1, embedding_multiplier=4.0, residual_multiplier=0.6,
                               attention_multiplier=0.3, logits_scaling=1.7, tie_word_embeddings=True, **c)
    if name == "starcoder2":  # LayerNorm + biases, gelu_pytorch_tanh MLP, tied
        return T.Starcoder2Config(num_key_value_heads=2, **c)
    if name == "starcoder2-window":  # every layer's window (16) shorter than most prompts
        return T.Starcoder2Config(num_key_value_heads=2, sliding_window=16, **c)
    if name == "gpt2":  # learned positions, Conv1D checkpoint, gelu_new, tied
        return T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.3,
                            bos_token_id=1, eos_token_id=2)
    if name == "gpt_neox":  # parallel residual, rotary over a quarter of each head, exact gelu
        return T.GPTNeoXConfig(**c)
    if name == "gpt_neox-sequential":  # sequential residual, half-head rotary
        return T.GPTNeoXConfig(use_parallel_residual=False, rotary_pct=0.5, **c)
    raise ValueError(name)
