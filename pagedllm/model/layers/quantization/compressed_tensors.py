"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor writes
them), one config group:
- FP8 linears: 8-bit float weights, per channel (`weight_scale` [N, 1]), per tensor or in blocks;
  activations dynamic per token, static per tensor (their `input_scale` is read, then
  activations are quantized per token anyway) or none;
- integer weight-only linears (W4A16 / W8A16, `format: pack-quantized`): 4- or 8-bit int
  weights in groups or per channel, symmetric or not, actorder, no activation quantization
  (wna16.py).
Other schemes are refused with the field that says so."""

from __future__ import annotations

from pagedllm.model.layers.quantization.base import QuantizationConfig
from pagedllm.model.layers.quantization.fp8 import Fp8Config

_FORMATS = ("float-quantized", "naive-quantized", None)


def compressed_tensors_config(qc: dict) -> QuantizationConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"model: compressed-tensors config_groups has {len(groups)} groups; one group is supported")
    (group,) = groups.values()
    if (group.get("weights") or {}).get("type") == "int":
        return compressed_tensors_wna16_config(qc)
    return compressed_tensors_fp8_config(qc)


def compressed_tensors_wna16_config(qc: dict):
    from pagedllm.model.layers.quantization.wna16 import WNA16Config

    _field("quantization_config.format", qc.get("format"), ("pack-quantized",), "integer weights are")
    ((gname, group),) = qc["config_groups"].items()
    w = group["weights"]
    where = f"config_groups.{gname}.weights"
    _field(f"{where}.num_bits", w.get("num_bits"), (4, 8), "integer weights are")
    _field(f"{where}.dynamic", w.get("dynamic", False), (False,), "integer weights are")
    strategy = w.get("strategy")
    _field(f"{where}.strategy", strategy, ("group", "channel"), "integer weights are")
    actorder = w.get("actorder")
    _field(f"{where}.actorder", actorder, (None, "group", "weight", "static", "dynamic"), "integer weights are")
    if group.get("input_activations") is not None:
        raise ValueError(f"model: compressed-tensors config_groups.{gname}.input_activations must be null for "
                         "integer weights (only weight-only W4A16 / W8A16 is supported)")
    group_size = int(w.get("group_size") or 128) if strategy == "group" else None
    # actorder "group" stores weight_g_idx; "weight" reorders at calibration only (no g_idx)
    return WNA16Config("compressed-tensors", int(w["num_bits"]), group_size, bool(w.get("symmetric", True)),
                       actorder in ("group", "dynamic"), tuple(qc.get("ignore") or ()), "compressed-tensors")


def _field(path: str, value, allowed, what: str = "FP8 weights are") -> None:
    if value not in allowed:
        raise ValueError(f"model: compressed-tensors {path}={value!r} is not supported (supported: "
                         f"{', '.join(repr(a) for a in allowed)}, where {what} concerned)")


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
