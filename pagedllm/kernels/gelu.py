"""Bias add + GELU, the activation of the plain (ungated) MLP of GPT-2, GPT-NeoX and StarCoder2:
gelu(x + bias), exact (erf) or with the tanh approximation. The projection before it runs
without its bias so the add is fused here. The sum is rounded to the input dtype, GELU is
computed in float32 and rounded once. The Triton version lives in gelu_triton.py; `bias_gelu`
uses it for CUDA tensors and the torch reference elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels._triton import use_triton

# transformers' `hidden_act` / `activation_function` names -> F.gelu's `approximate`
# (gelu_new, gelu_fast and gelu_pytorch_tanh are one function written three ways)
GELU_APPROXIMATIONS = {
    "gelu": "none",
    "gelu_python": "none",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu_pytorch_tanh": "tanh",
    "gelu_python_tanh": "tanh",
}


def gelu_approximation(hidden_act: str) -> str:
    """'none' or 'tanh' for a transformers activation name; ValueError for any other."""
    if hidden_act not in GELU_APPROXIMATIONS:
        raise ValueError(
            f"hidden_act={hidden_act!r} is not supported for a GELU MLP; supported: {', '.join(sorted(GELU_APPROXIMATIONS))}"
        )
    return GELU_APPROXIMATIONS[hidden_act]


def bias_gelu_torch(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    # x: [T, N], bias: [N] -> [T, N]
    y = x if bias is None else x + bias
    if y.dtype == torch.float32:
        return F.gelu(y, approximate=approximate)
    return F.gelu(y.float(), approximate=approximate).to(y.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    if use_triton(x):
        from pagedllm.kernels.gelu_triton import bias_gelu_triton

        return bias_gelu_triton(x, bias, approximate)
    return bias_gelu_torch(x, bias, approximate)
