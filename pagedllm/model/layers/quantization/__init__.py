"""Quantization methods for the linear layers (see base.py for the interface): `quantization`
(what the user asked for) and the checkpoint's `quantization_config` resolve here to one
`QuantizationConfig`, or None for a plain model."""

from __future__ import annotations

from typing import Any

from pagedllm.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    process_weights_after_loading,
    quantize_model,
)

QUANTIZATION_METHODS = ("fp8", "gptq", "awq", "compressed-tensors", "gguf", "none")

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "get_quantization_config",
           "process_weights_after_loading", "quantize_model"]


def _checkpoint_quantization(hf_config: Any) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def _gguf_config(quantization: str | None, model: str | None, load_format: str, device: str,
                 dtype: str) -> QuantizationConfig | None:
    """A .gguf model: executed in its blocks on the CPU (quantization None or "gguf"), else
    dequantized at load (on a GPU, in another dtype, with quantization="none", or without a C
    compiler under auto)."""
    from pagedllm.kernels import gguf_kernels
    from pagedllm.model.layers.quantization.gguf import GGUFConfig

    if quantization == "gguf":
        problem = (None if load_format == "gguf" else "needs a .gguf model") or \
            (None if device == "cpu" else "runs on the CPU only (on a GPU the GGUF weights are dequantized: "
                                          "leave quantization unset)") or \
            (None if dtype == "float32" else f"runs float32 activations, not dtype={dtype}") or \
            (None if gguf_kernels.available() else "needs the GGUF CPU kernels (a C compiler; "
                                                    "PAGEDLLM_CPU_KERNELS not 0)")
        if problem:
            raise ValueError(f"quantization='gguf' {problem}")
    elif quantization is not None or load_format != "gguf" or device != "cpu" or dtype != "float32" \
            or not gguf_kernels.available():
        return None
    return GGUFConfig.from_file(model)


def get_quantization_config(quantization: str | None, hf_config: Any, load_format: str, model: str | None = None,
                            device: str = "cpu", dtype: str = "float32") -> QuantizationConfig | None:
    """`quantization` None: whatever the checkpoint says (nothing for a plain one; a .gguf file
    on the CPU in float32: its blocks, executed by the GGUF kernels). "fp8" on a plain checkpoint
    (or dummy weights): online FP8. "gguf": a .gguf file's blocks, executed on the CPU. "none":
    no quantized weights (a .gguf file dequantized to `dtype` at load). Raises ValueError on a
    mismatch or an unsupported checkpoint format."""
    from pagedllm.model.layers.quantization.fp8 import Fp8Config

    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None); got {quantization!r}")
    if quantization in (None, "gguf"):
        gguf_config = _gguf_config(quantization, model, load_format, device, dtype)
        if gguf_config is not None:
            return gguf_config
    qc = _checkpoint_quantization(hf_config)
    method = None if qc is None else qc.get("quant_method")
    if quantization == "none":
        if method is not None and load_format not in ("dummy", "gguf"):
            raise ValueError(f"quantization='none' does not fit a quant_method={method!r} checkpoint")
        return None
    if method is None or load_format in ("dummy", "gguf"):
        # random weights are drawn in the model's dtype and quantized like a plain checkpoint's:
        # fp8 per channel; gptq / compressed-tensors: int4 symmetric in groups of 128, awq the same
        # asymmetric (the common checkpoints' settings)
        if quantization in ("gptq", "awq", "compressed-tensors"):
            if load_format != "dummy":
                raise ValueError(f"quantization={quantization!r} needs a {quantization} checkpoint (or load_format="
                                 "'dummy'); use quantization='fp8' to quantize this model at load")
            from pagedllm.model.layers.quantization.wna16 import WNA16Config

            return WNA16Config("online", 4, 128, quantization != "awq", name=quantization)
        return Fp8Config() if quantization is not None else None
    if method == "fp8":
        cfg = Fp8Config.from_hf(qc)
    elif method == "compressed-tensors":
        from pagedllm.model.layers.quantization.compressed_tensors import compressed_tensors_config

        cfg = compressed_tensors_config(qc)
    elif method in ("gptq", "awq"):
        from pagedllm.model.layers.quantization.wna16 import WNA16Config

        cfg = WNA16Config.from_gptq(qc) if method == "gptq" else WNA16Config.from_awq(qc)
    else:
        raise ValueError(f"model: quantization_config.quant_method={method!r} is not supported "
                         f"(supported: {', '.join(QUANTIZATION_METHODS)})")
    if quantization is not None and quantization != method and not (quantization == "fp8" and cfg.name == "fp8"):
        raise ValueError(f"quantization={quantization!r} does not match the checkpoint's quant_method={method!r}")
    return cfg


def precision_summary(model_dtype: str, quantization: QuantizationConfig | None, cache_dtype: str,
                      device: str, lm_head_quantized: bool = False) -> dict[str, str]:
    """What each part runs in, for the startup plan and /metrics: weights of the linears,
    activations, KV cache, embedding / LM head (`lm_head_quantized`: the built model's head has
    a quantization method of its own)."""
    from pagedllm.kernels.fp8 import SCALED_MM_MIN_ROWS

    activations = model_dtype
    if quantization is not None and quantization.name == "fp8" and device == "cuda":
        activations = f"{model_dtype} (fp8 e4m3 per token from {SCALED_MM_MIN_ROWS} rows)"
    return {
        "weights": quantization.describe() if quantization is not None else model_dtype,
        "activations": activations,
        "kv_cache": model_dtype if cache_dtype == "auto" else cache_dtype,
        "lm_head": (f"gguf {quantization.head_type}" if quantization is not None and quantization.name == "gguf"
                    else "fp8 e4m3 (per-row scales, online)" if lm_head_quantized and quantization is not None
                    and quantization.name == "fp8" else model_dtype),
    }
