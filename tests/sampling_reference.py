"""Sampling references for the tests: what the engine's sampler must equal, from plain lists."""

from __future__ import annotations

import torch


def penalized_greedy_reference(hf, prompt: list[int], n: int, rep: float = 1.0, freq: float = 0.0, pres: float = 0.0,
                               min_tokens: int = 0, banned=()) -> list[int]:
    """Greedy decoding on transformers' logits (full forward each token) with the penalties
    applied from plain lists (vLLM's definitions: repetition over prompt + output,
    frequency/presence over the output) and `banned` ids at -inf until `min_tokens` are out."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float()
        for t in set(ids):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        if len(out) < min_tokens:
            logits[list(banned)] = float("-inf")
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out
