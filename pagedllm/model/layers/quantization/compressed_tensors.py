"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor writes
them) whose linears are FP8: one config group with 8-bit float weights, per channel
(`weight_scale` [N, 1]), per tensor or in blocks; activations dynamic per token, static per
tensor (their `input_scale` is read, then activations are quantized per token anyway) or none.
Other schemes (int4/int8 weights: the 4-bit issue) are refused with the field that says so."""

from __future__ import annotations

from pagedllm.model.layers.quantization.fp8 import Fp8Config

_FORMATS = ("float-quantized", "naive-quantized", None)


def _field(path: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"model: compressed-tensors {path}={value!r} is not supported (supported: "
                         f"{', '.join(repr(a) for a in allowed)}; only FP8 linears are)")


def compressed_tensors_fp8_config(qc: dict) -> Fp8Config:
    _field("quantization_config.format", qc.get("format"), _FORMATS)
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"model: compressed-tensors config_groups has {len(groups)} groups; one FP8 group is supported")
    (gname, group), = groups.items()
    w = group.get("weights") or {}
    where = f"config_groups.{gname}.weights"
    _field(f"{where}.type", w.get("type"), ("float",))
    _field(f"{where}.num_bits", w.get("num_bits"), (8,))
    _field(f"{where}.symmetric", w.get("symmetric", True), (True,))
    _field(f"{where}.dynamic", w.get("dynamic", False), (False,))
    strategy = w.get("strategy")
    _field(f"{where}.strategy", strategy, ("channel", "tensor", "block"))
    block = None
    if strategy == "block":
        bs = w.get("block_structure") or [128, 128]
        if len(bs) != 2:
            raise ValueError(f"model: compressed-tensors {where}.block_structure={bs!r} must be [rows, cols]")
        block = (int(bs[0]), int(bs[1]))
    a = group.get("input_activations")
    static = False
    if a is not None:
        where = f"config_groups.{gname}.input_activations"
        _field(f"{where}.type", a.get("type"), ("float",))
        _field(f"{where}.num_bits", a.get("num_bits"), (8,))
        static = not a.get("dynamic", False)
        _field(f"{where}.strategy", a.get("strategy"), ("token", "tensor", "group") if not static else ("tensor",))
    ignored = tuple(qc.get("ignore") or ())
    return Fp8Config(strategy, block, "weight_scale", static, ignored, "compressed-tensors")
