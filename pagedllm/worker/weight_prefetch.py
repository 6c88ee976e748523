"""Weights pulled into L2 while a small decode batch attends (CUDA graphs of few rows, sm_90+).

At a few rows a decode step reads its weights once, so the linears are bound by HBM, while the
kernels between them (rotary, store-KV, the attention over a few hundred keys, the norms) leave
HBM idle for several microseconds a layer. During that window this side stream asks L2 for the
weights the next linears will read (the o projection, then the start of the MLP's), so those
GEMVs read part of their bytes from L2:

    main:   qkv GEMV ─┬─ rotary / store-KV ─ attention ─ reduce ─ o GEMV ─ norm ─ gate_up GEMV ...
    side:             └─ prefetch(o_proj.weight, gate_up_proj.weight[:rest of the budget])

The side stream forks after the qkv projection (a forward hook) and joins the main stream at the
end of the forward pass; the prefetch kernel writes nothing, so no kernel waits on it. It runs
only inside the decode graphs of at most `max_batch` rows (DecodeGraphs), never in eager steps.
PAGEDLLM_L2_PREFETCH_MB sets the bytes asked per layer (0: off).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.kernels.l2_prefetch import l2_prefetch, l2_prefetch_supported

# H200: 50 MB of L2; what a layer asks for must still be there when its GEMV runs
DEFAULT_BUDGET_MB = 24
DEFAULT_MAX_BATCH = 8


def prefetch_budget_bytes() -> int:
    raw = os.environ.get("PAGEDLLM_L2_PREFETCH_MB", str(DEFAULT_BUDGET_MB))
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"PAGEDLLM_L2_PREFETCH_MB={raw!r} must be a number of megabytes") from None
    if mb < 0:
        raise ValueError(f"PAGEDLLM_L2_PREFETCH_MB={raw!r} must be >= 0")
    return int(mb * 1e6)


def prefetch_plan(model: nn.Module, budget: int) -> list[tuple[nn.Module, list[tuple[torch.Tensor, int]]]]:
    """[(the module whose output forks the side stream, [(weight, bytes to ask), ...]), ...]:
    per decoder layer with a fused qkv projection, the o projection's weight and then the MLP's
    linears in the order they run, up to `budget` bytes. A layer whose MLP is not a plain gated
    pair (a mixture of experts: which experts run depends on the router) asks for o alone."""
    plan = []
    for layer in model.modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        qkv, o = getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None)
        if qkv is None or o is None:
            continue
        targets = [o] + [getattr(mlp, name) for name in ("gate_up_proj", "down_proj") if hasattr(mlp, name)]
        spans, left = [], budget
        for linear in targets:
            w = getattr(linear, "weight", None)
            if not isinstance(w, torch.Tensor) or left <= 0:
                break
            n = min(left, w.numel() * w.element_size())
            spans.append((w, n))
            left -= n
        if spans:
            plan.append((qkv, spans))
    return plan


class WeightPrefetcher:
    def __init__(self, model: nn.Module, device: torch.device, budget: int, max_batch: int = DEFAULT_MAX_BATCH):
        self.plan = prefetch_plan(model, budget)
        self.max_batch = max_batch
        self.stream = torch.cuda.Stream(device)

    @classmethod
    def create(cls, model: nn.Module, device: torch.device) -> WeightPrefetcher | None:
        """The prefetcher for `model` on `device`, or None where it does not apply (off, no
        sm_90, nothing to prefetch)."""
        budget = prefetch_budget_bytes()
        if budget == 0 or device.type != "cuda" or not l2_prefetch_supported(device.index or 0):
            return None
        p = cls(model, device, budget)
        return p if p.plan else None

    def _hook(self, spans: list[tuple[torch.Tensor, int]]):
        def fork_and_prefetch(module: nn.Module, args, output) -> None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for w, n in spans:
                    l2_prefetch(w, n)

        return fork_and_prefetch

    @contextlib.contextmanager
    def around(self, batch_size: int) -> Iterator[None]:
        """Prefetches inside this block's forward pass when the batch is small enough; joins
        the side stream to the current one on the way out (a graph capture needs it joined)."""
        if batch_size > self.max_batch:
            yield
            return
        handles = [m.register_forward_hook(self._hook(spans)) for m, spans in self.plan]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            torch.cuda.current_stream().wait_stream(self.stream)
