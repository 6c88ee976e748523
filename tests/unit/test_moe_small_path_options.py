"""The switch of the MoE small-batch path (kernels/fused_moe.py: small_path_options) and its
dispatch on the CPU, where the torch loop always runs."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.fused_moe import fused_experts_torch, fused_moe, small_path_options, topk_softmax_torch


def test_options_default_off_and_read_from_the_environment():
    assert small_path_options({}) == (0, True)
    assert small_path_options({"PAGEDLLM_MOE_SMALL_PAIRS": "16", "PAGEDLLM_MOE_SMALL_DOT": "0"}) == (16, False)


@pytest.mark.parametrize("raw", ["x", "-1", "1.5"])
def test_bad_pair_count_names_the_variable(raw):
    with pytest.raises(ValueError, match="PAGEDLLM_MOE_SMALL_PAIRS"):
        small_path_options({"PAGEDLLM_MOE_SMALL_PAIRS": raw})


def test_cpu_tensors_take_the_torch_path_whatever_the_switch():
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(2, 16, generator=g), torch.randn(2, 8, generator=g)
    w13, w2 = torch.randn(8, 24, 16, generator=g), torch.randn(8, 16, 12, generator=g)
    ref = fused_experts_torch(x, w13, w2, *topk_softmax_torch(logits, 2, False))
    assert torch.equal(fused_moe(x, logits, w13, w2, 2, False, small_max_pairs=64), ref)
