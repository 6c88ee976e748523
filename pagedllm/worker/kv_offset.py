"""FP8 KV caches storing K less a per-layer, per-channel offset, calibrated at startup.

An attention layer's scores of a query q are q . k_j over its keys; if every stored key is k_j - c
(one vector c per layer and kv head), every score of q moves by the same q . c and the softmax is
unchanged: the attention is the same, exactly, for any c. What changes is what the cache rounds:
e4m3 keeps about 3 significant bits of each value, so its error scales with |k - c| instead of
|k|, and keys carry a large component shared by every token (SmolLM2-135M: a channel's mean up to
6-16 against a mean |k| of 1-1.6). Stored less their mean, the embedded model's FP8 cache agrees
with float32 on 94.03% of the next tokens of Python's documentation instead of 92.83%, mean KL
0.01249 against 0.01797 nats (calibrated on random tokens as here; 0.01074 on English text:
benchmarks/fp8_kv_offset.py), and on 600 tokens of the README 94.67% instead of 93.17%, KL 0.00804
against 0.00849 (tests/models/test_fp8_accuracy.py; RESULTS.md nineteenth session).

The offset is the mean post-rotary key of one prefill of random tokens (a fixed seed, so every
replica and every tensor-parallel rank calibrates alike; each rank its own kv heads), run through
the model once the cache is allocated and before CUDA graphs are captured (which read the offsets
in place). Layers with a logit soft cap keep K as it is (a capped score is not shift-invariant);
so does every layer under pipeline parallelism (one stage's step alone has no real hidden states).
V is stored as it is: its offset bought nothing more (the same benchmark).

On by default for FP8 caches (PAGEDLLM_FP8_KV_OFFSET=0 stores K as it is): on the H100 W1 with an
FP8 cache ran 27,831.6 tok/s with it against 27,259.4 without (medians of two alternated rounds,
RESULTS.md twentieth session), and the kernel's GPU tests pass.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.kernels._triton import env_flag
from pagedllm.model.layers.attention import Attention
from pagedllm.worker.profiling import prefill_batch

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0


def enabled() -> bool:
    """PAGEDLLM_FP8_KV_OFFSET (read at each calibration; 1, the default, or 0): FP8 caches store K
    less its offset."""
    return env_flag("PAGEDLLM_FP8_KV_OFFSET", default=True)


def offset_layers(model: torch.nn.Module) -> list[Attention]:
    """The attention layers whose K may be stored less an offset (no logit soft cap)."""
    return [m for m in model.modules() if isinstance(m, Attention) and m.logits_soft_cap is None]


@torch.inference_mode()
def calibrate_k_offsets(model: torch.nn.Module, vocab_size: int, num_blocks: int, block_size: int,
                        max_model_len: int, device: torch.device) -> int:  # fmt: skip
    """Sets each offset layer's `k_offset` [Hkv, D] float32 to its mean stored key over one prefill
    of random tokens, written into the bound cache's first blocks (garbage to the block manager,
    which writes every slot before a request reads it). Returns the tokens it ran (0: none fit)."""
    layers = offset_layers(model)
    n = min(CALIBRATION_TOKENS, max_model_len, num_blocks * block_size)
    if not layers or n == 0:
        return 0
    g = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, vocab_size, (n,), generator=g).to(device)
    for layer in layers:
        layer.k_offset, layer.k_stats = None, [0.0, 0]
    try:
        batch = prefill_batch(ids, [n], block_size, 1)
        model(batch.input_ids, batch.positions, batch)
        for layer in layers:
            assert layer.k_stats is not None
            total, count = layer.k_stats
            layer.k_offset = (total / count).float().contiguous()
    finally:
        for layer in layers:
            layer.k_stats = None
    return n


def layer_offsets(model: torch.nn.Module) -> list[torch.Tensor | None]:
    """Each attention layer's K offset [Hkv, D] on the CPU (None: K stored as it is), in layer order."""
    return [None if m.k_offset is None else m.k_offset.cpu() for m in model.modules() if isinstance(m, Attention)]


def maybe_calibrate(worker) -> None:
    """The worker's startup step: calibrate where the cache is FP8, the switch is on and the worker
    holds the whole model (one pipeline stage)."""
    if worker.kv_dtype.itemsize != 1 or not enabled():
        return
    tag = worker._tag()
    if worker.ps.pp_size > 1:
        logger.info("%sFP8 KV cache: K stored as it is (no offsets under pipeline parallelism)", tag)
        return
    mc, cc = worker.config.model_config, worker.config.cache_config
    n = calibrate_k_offsets(worker.model, mc.vocab_size, worker.num_gpu_blocks, cc.block_size, mc.max_model_len,
                            worker.device)  # fmt: skip
    logger.info("%sFP8 KV cache: K stored less per-channel offsets calibrated on %d random tokens", tag, n)
