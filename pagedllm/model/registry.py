"""Model classes by the `architectures` name in config.json."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("pagedllm.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedllm.model.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagedllm.model.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedllm.model.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pagedllm.model.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("pagedllm.model.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("pagedllm.model.models.mixtral", "MixtralForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(architectures: list[str]) -> str:
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ValueError(
        f"model: architectures {architectures} are not supported; supported: {', '.join(supported_architectures())}"
    )


def get_model_class(architecture: str):
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
