"""`sample` on 16-bit logits (what a bf16 LM head gives; the CUDA graphs no longer copy them to
float32) draws exactly what it draws from the same values in float32, on every path: greedy,
temperature, top-k / top-p / min-p, per-request seeds, penalties, logit bias, bans, allowed ids
and a grammar bitmask. On the CPU every path but the greedy argmax works on a float32 copy; the
fused GPU kernel reading bf16 is checked in tests/gpu/test_sampling_gpu.py (and its interpreter run)."""

import pytest
import torch

from pagedllm.model.logits_processors import LogitsEdits
from pagedllm.model.sampler import SamplingBatch, sample
from pagedllm.structured_output.matcher import bitmask_width

S, V = 6, 300


def _batch(kind: str) -> SamplingBatch:
    none = [None] * S
    sb = SamplingBatch(
        temperature=torch.full((S,), 0.7), greedy=torch.zeros(S, dtype=torch.bool), all_greedy=False,
        top_k=None, top_p=None, min_p=None, presence=None, frequency=None, repetition=None, output_counts=None,
        prompt_mask=None, history_rows=None, edits=LogitsEdits(), generators=list(none), num_logprobs=list(none),
    )  # fmt: skip
    if kind == "greedy":
        sb.greedy[:] = True
        sb.all_greedy = True
        sb.temperature[:] = 1.0
    elif kind == "top":
        sb.top_k = torch.tensor([5, V, 50, V, 1, 20])
        sb.top_p = torch.tensor([1.0, 0.9, 0.5, 0.8, 1.0, 0.95])
        sb.min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.0])
    elif kind == "seeded":
        sb.generators = [torch.Generator().manual_seed(i) for i in range(S)]
    elif kind == "penalties":
        counts = torch.randint(0, 3, (S, V), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
        sb.output_counts = counts
        sb.prompt_mask = torch.rand(S, V, generator=torch.Generator().manual_seed(2)) < 0.2
        sb.repetition = torch.full((S,), 1.3)
        sb.frequency = torch.full((S,), 0.4)
        sb.presence = torch.full((S,), 0.6)
    elif kind == "edits":
        sb.edits = LogitsEdits(bias=[(0, {3: 5.0, 7: -2.0})], allowed=[(1, [10, 11, 12])], banned=[(2, [4, 5])])
    elif kind == "bitmask":
        g = torch.Generator().manual_seed(3)
        mask = torch.randint(-(2**31), 2**31 - 1, (2, bitmask_width(V)), generator=g, dtype=torch.int64)
        sb.edits = LogitsEdits(bitmask=mask.to(torch.int32), bitmask_rows=torch.tensor([0, 3]),
                               bitmask_row_map=torch.tensor([0, -1, -1, 1, -1, -1], dtype=torch.int32))
        sb.greedy[::2] = True
    return sb


@pytest.mark.parametrize("kind", ["greedy", "temperature", "top", "seeded", "penalties", "edits", "bitmask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_draw_what_float32_draws(kind, dtype):
    logits = (torch.randn(S, V, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    draws = []
    for x in (logits, logits.float()):
        sb = _batch(kind)
        draws.append(sample(x, sb, torch.Generator().manual_seed(42)))
    assert draws[0].dtype == torch.int64 and draws[0].shape == (S,)
    assert torch.equal(draws[0], draws[1]), f"{kind}: {draws[0].tolist()} vs {draws[1].tolist()}"
    if kind == "greedy":
        assert torch.equal(draws[0], logits.float().argmax(-1))
