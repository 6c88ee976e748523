"""4- and 8-bit weight-only checkpoints on the CPU: tiny Llama checkpoints written here in the GPTQ
(group 32 / 64 / 128, desc_act off and on, v1 and v2 zeros, symmetric and asymmetric, 8-bit), AWQ
(GEMM packing) and compressed-tensors pack-quantized (group / channel, symmetric / asymmetric,
actorder) formats by this file's own packing code, written from the formats' descriptions
(independent of pagedllm's unpacking). Checked: every layer computes with exactly the weights a
reference dequantizer gives from the integers, scales and zeros (also on each tensor-parallel
rank, which holds its slice of them); greedy tokens equal transformers' on those dequantized
weights; the format is detected from the checkpoint; mismatches and unsupported fields are
refused naming the field.

transformers' own integrations are not run: GPTQ needs optimum + gptqmodel, AWQ autoawq, and
compressed-tensors the compressed-tensors package; none is installed here (the logits are
compared on the dequantized weights instead)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import save_tiny_model, tiny_config
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.distributed import ParallelState
from pagedllm.model.loader import build_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 77, 300, 12, 9000, 41], list(range(100, 137))]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

# name -> (format, bits, group size (-1: per channel), symmetric, act-order)
FORMATS = {
    "gptq-g32-asym": ("gptq", 4, 32, False, False),
    "gptq-g64-sym": ("gptq", 4, 64, True, False),
    "gptq-g128-sym-descact": ("gptq", 4, 128, True, True),
    "gptq_v2-g64-asym-descact": ("gptq_v2", 4, 64, False, True),
    "gptq-int8-g128-sym": ("gptq", 8, 128, True, False),
    "awq-g64": ("awq", 4, 64, False, False),
    "awq-g128": ("awq", 4, 128, False, False),
    "ct-g128-sym": ("ct", 4, 128, True, False),
    "ct-g32-asym-actorder": ("ct", 4, 32, False, True),
    "ct-channel-asym": ("ct", 4, -1, False, False),
    "ct-int8-channel-sym": ("ct", 8, -1, True, False),
}


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in LINEARS)


def _pack(values: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> torch.Tensor:
    """Unsigned ints along `axis` into int32 words: value i of each run of 32 / bits at bits
    bits * i, or (order) value i of a word is element order[i] of its run."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    p = 32 // bits
    runs = v.reshape(v.shape[0] // p, p, *v.shape[1:])
    word = np.zeros(runs.shape[:1] + runs.shape[2:], dtype=np.uint32)
    for i in range(p):
        word |= runs[:, (order[i] if order else i)] << np.uint32(bits * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(word, 0, axis)).view(np.int32))


def _quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool, perm: torch.Tensor | None, min_zero: int):
    """Round to nearest. Returns q [K, N], scales [G, N] float16, zeros [G, N], g_idx [K], the
    dequantized weight [N, K]."""
    n, k = w.shape
    gs = k if group == -1 else group
    g_idx = torch.arange(k) // gs
    if perm is not None:  # act-order: groups of gs inputs in a permuted order of the inputs
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // gs
    qmax = (1 << bits) - 1
    wt = w.t().double()
    q = torch.empty(k, n, dtype=torch.long)
    groups = k // gs
    scales, zeros = torch.empty(groups, n, dtype=torch.float16), torch.empty(groups, n, dtype=torch.long)
    for gi in range(groups):
        rows = wt[g_idx == gi]
        if symmetric:
            s, z = rows.abs().amax(0) / (qmax / 2), torch.full((n,), 1 << (bits - 1), dtype=torch.long)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            s = (hi - lo) / qmax
            z = torch.round(-lo / s).long().clamp(min_zero, qmax)
        scales[gi] = s.clamp(min=1e-6).half()
        zeros[gi] = z
        q[g_idx == gi] = torch.round(rows / scales[gi].double() + z).long().clamp(0, qmax)
    deq = ((q - zeros[g_idx]).double() * scales[g_idx].double()).float().t().contiguous()
    return q, scales, zeros, g_idx, deq


def write_checkpoint(src: str, dst: str, spec: tuple) -> str:
    """The checkpoint of `src` in `spec`'s format in `dst`, and in dst + "-ref" the plain one of
    its dequantized weights."""
    fmt, bits, group, symmetric, act_order = spec
    gen = torch.Generator().manual_seed(7)
    perms: dict[str, torch.Tensor] = {}  # projections of one input share GPTQ's order (its Hessian's)
    out, ref = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if not _is_linear(name):
            out[name] = ref[name] = w
            continue
        base = name[: -len("weight")]
        key = base.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=gen)) if act_order else None
        q, s, z, g_idx, ref[name] = _quantize(w, bits, group, symmetric, perm, 1 if fmt == "gptq" else 0)
        qn, zn = q.numpy(), z.numpy()
        if fmt in ("gptq", "gptq_v2"):
            out[base + "qweight"] = _pack(qn, bits, 0)
            out[base + "qzeros"] = _pack(zn - (1 if fmt == "gptq" else 0), bits, 1)
            out[base + "scales"], out[base + "g_idx"] = s, g_idx.int()
        elif fmt == "awq":
            out[base + "qweight"], out[base + "qzeros"] = _pack(qn, 4, 1, AWQ_ORDER), _pack(zn, 4, 1, AWQ_ORDER)
            out[base + "scales"] = s
        else:
            out[base + "weight_packed"] = _pack(qn.T, bits, 1)  # [N, K/P], values offset by 2**(bits-1)
            out[base + "weight_scale"] = s.t().contiguous()
            out[base + "weight_shape"] = torch.tensor(list(w.shape))
            if not symmetric:
                out[base + "weight_zero_point"] = _pack(zn.T, bits, 0)
            if act_order:
                out[base + "weight_g_idx"] = g_idx.int()
    for d, tensors in ((dst, out), (dst + "-ref", ref)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors":
                shutil.copy(os.path.join(src, f), d)
        save_file(tensors, os.path.join(d, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    if fmt in ("gptq", "gptq_v2"):
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": fmt}
    elif fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
                   "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
                   "actorder": "group" if act_order else None}
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return dst


def hf_greedy(path: str, prompts, n: int = 10) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                        attention_mask=torch.ones_like(ids))
        outs.append(g[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer_dir) -> str:
    cfg = tiny_config("llama", hidden=256, heads=4, kv_heads=2, layers=2, initializer_range=0.05)
    return save_tiny_model(cfg, str(tmp_path_factory.mktemp("plain")), tokenizer_dir, seed=3)


# CI runs one case of each format (and both act-order kinds); the rest behind `extended`
CORE = ("gptq-g32-asym", "gptq-g128-sym-descact", "gptq-int8-g128-sym", "awq-g128", "ct-g32-asym-actorder",
        "ct-channel-asym")


@pytest.fixture(scope="module", params=[f if f in CORE else pytest.param(f, marks=pytest.mark.extended) for f in FORMATS])
def checkpoint(request, plain, tmp_path_factory) -> tuple[str, str, tuple]:
    spec = FORMATS[request.param]
    dst = write_checkpoint(plain, str(tmp_path_factory.mktemp(request.param) / "ckpt"), spec)
    return dst, dst + "-ref", spec


def _effective(layer) -> torch.Tensor:
    """The [N, K] weight a layer computes with: its product with the identity."""
    k = layer.in_features if hasattr(layer, "in_features") else layer.in_per_rank
    return layer.quant_method.apply(layer, torch.eye(k), None).t()


def _model_config(path):
    return EngineArgs(model=path).create_engine_config().model_config


def test_layers_compute_with_the_reference_dequantized_weights(checkpoint):
    path, ref, spec = checkpoint
    mc = _model_config(path)
    assert mc.quantization.bits == spec[1] and mc.quantization.symmetric == spec[3]
    layer = build_model(mc, "cpu").model.layers[1]
    sd = load_file(os.path.join(ref, "model.safetensors"))
    p = "model.layers.1."
    expected = {
        "self_attn.qkv_proj": torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "self_attn.o_proj": sd[p + "self_attn.o_proj.weight"],
        "mlp.gate_up_proj": torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
        "mlp.down_proj": sd[p + "mlp.down_proj.weight"],
    }
    for name, w in expected.items():
        mod = layer.get_submodule(name)
        assert mod.qweight.dtype == torch.int32 and not hasattr(mod, "weight")
        torch.testing.assert_close(_effective(mod), w, atol=1e-6, rtol=1e-6, msg=name)
        assert (mod.zeros is None) == spec[3]


def test_greedy_tokens_equal_hf_on_dequantized_weights(checkpoint):
    path, ref, _ = checkpoint
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(ref, PROMPTS)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_groups_and_scales_shard_with_their_weights(checkpoint, tp):
    """Each rank's effective projections are its slices of the whole model's."""
    path, _, spec = checkpoint
    if tp == 4 and spec[2] in (128, -1) and not spec[4]:
        pytest.skip("o_proj's 64 input columns per rank do not hold a group of 128 (refused below)")
    mc = _model_config(path)
    full = build_model(mc, "cpu").model.layers[1]
    ranks = [build_model(mc, "cpu", ParallelState(tp_rank=r, tp_size=tp)).model.layers[1] for r in range(tp)]
    fq, fk, fv = _effective(full.self_attn.qkv_proj).split([256, 128, 128])
    fg, fu = _effective(full.mlp.gate_up_proj).chunk(2)
    kv_rows = 128 // min(tp, 2)
    for r, layer in enumerate(ranks):
        q, k, v = _effective(layer.self_attn.qkv_proj).split([256 // tp, kv_rows, kv_rows])
        kr = r // max(1, tp // 2)
        assert torch.equal(q, fq.chunk(tp)[r]) and torch.equal(k, fk.chunk(min(tp, 2))[kr])
        assert torch.equal(v, fv.chunk(min(tp, 2))[kr])
        g, u = _effective(layer.mlp.gate_up_proj).chunk(2)
        assert torch.equal(g, fg.chunk(tp)[r]) and torch.equal(u, fu.chunk(tp)[r])
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            mine, whole = layer.get_submodule(name), full.get_submodule(name)
            torch.testing.assert_close(_effective(mine), _effective(whole).chunk(tp, dim=1)[r], atol=1e-6, rtol=0,
                                       msg=name)


def test_swap_layout_holds_the_same_weights(checkpoint, monkeypatch):
    """PAGEDLLM_WNA16_SWAP=1: 4-bit layers are repacked N-major ([N, K/8] words, [N, G] scales)
    after loading and sharding, and still compute with the reference weights, whole and on each
    of 2 tensor-parallel ranks (act-order included); 8-bit layers keep the K-packed layout."""
    monkeypatch.setenv("PAGEDLLM_WNA16_SWAP", "1")
    _, _, spec = checkpoint
    layer = build_model(_model_config(checkpoint[0]), "cpu").model.layers[1]
    down = layer.mlp.down_proj  # 256 outputs
    assert down.quant_method.int4_nk == (spec[1] == 4)
    if spec[1] == 4:
        assert down.qweight.shape[0] == down.scales.shape[0] == 256
    else:
        assert down.qweight.shape[1] == down.scales.shape[1] == 256
    test_layers_compute_with_the_reference_dequantized_weights(checkpoint)
    test_groups_and_scales_shard_with_their_weights(checkpoint, 2)


def test_steps_permuted_layout_holds_the_same_weights(checkpoint, monkeypatch):
    """PAGEDLLM_WNA16_KPERM=1: 4-bit layers whose inputs and groups are whole steps of 128 (groups
    of 128, per channel, act-order's sorted groups) store their words in the steps-permuted
    layout after loading and sharding, and still compute with the reference weights, whole and on
    each of 2 tensor-parallel ranks; other layers keep the plain K-packed layout."""
    from pagedllm.kernels import wna16

    monkeypatch.setenv("PAGEDLLM_WNA16_KPERM", "1")
    wna16.kperm_enabled.cache_clear()
    try:
        _, _, spec = checkpoint
        layer = build_model(_model_config(checkpoint[0]), "cpu").model.layers[1]
        for name in ("self_attn.qkv_proj", "mlp.down_proj"):
            mod = layer.get_submodule(name)
            k = mod.qweight.shape[0] * (32 // spec[1])
            assert mod.kperm == (spec[1] == 4 and spec[2] in (128, -1) and k % 128 == 0), (name, spec)
        test_layers_compute_with_the_reference_dequantized_weights(checkpoint)
        test_groups_and_scales_shard_with_their_weights(checkpoint, 2)
    finally:
        wna16.kperm_enabled.cache_clear()


def kperm_engine_tokens(tmp_path, tokenizer_dir, monkeypatch) -> dict[str, list[list[int]]]:
    """Greedy tokens of a tiny act-order GPTQ checkpoint (groups of 128) with PAGEDLLM_WNA16_KPERM
    "0" and "1", each engine's layers checked to have taken the layout it asks for."""
    from pagedllm.kernels import wna16

    cfg = tiny_config("llama", hidden=256, heads=4, kv_heads=2, layers=2, initializer_range=0.05)
    plain = save_tiny_model(cfg, str(tmp_path / "plain"), tokenizer_dir, seed=3)
    path = write_checkpoint(plain, str(tmp_path / "ckpt"), FORMATS["gptq-g128-sym-descact"])
    tokens = {}
    try:
        for on in ("0", "1"):
            monkeypatch.setenv("PAGEDLLM_WNA16_KPERM", on)
            wna16.kperm_enabled.cache_clear()
            llm = LLM(path, kv_cache_memory="64MiB", max_model_len=256)
            assert llm.llm_engine.executor.worker.model.model.layers[0].mlp.down_proj.kperm == (on == "1")
            tokens[on] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            del llm
    finally:
        wna16.kperm_enabled.cache_clear()
    return tokens


def test_engine_tokens_on_the_steps_permuted_layout(tmp_path, tokenizer_dir, monkeypatch):
    """The engine decodes the same greedy tokens with its 4-bit layers in the steps-permuted layout
    (on the CPU the weight is dequantized to the same matrix either way: exactly the same)."""
    tokens = kperm_engine_tokens(tmp_path, tokenizer_dir, monkeypatch)
    assert tokens["1"] == tokens["0"]


def test_split_inside_a_group_is_refused(checkpoint):
    path, _, spec = checkpoint
    if spec[2] != 128 or spec[4]:
        pytest.skip("group 128 without act-order only")
    with pytest.raises(ValueError, match="tensor_parallel_size=4.* groups of 128"):
        build_model(_model_config(path), "cpu", ParallelState(tp_rank=0, tp_size=4))


# ------------------------------------------------------------------------------ validation


def _with_qc(plain, tmp_path, qc) -> str:
    d = tmp_path / "ckpt"
    shutil.copytree(plain, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("qc,quantization,match", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None, "version='gemv'"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, None, "bits=3"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 128}, None, "bits=2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, None, "group_size=100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq", "does not match the checkpoint's quant_method='gptq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        "input_activations": {"num_bits": 8, "type": "int"}}}}, None, "g.input_activations must be null"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, None,
     "format='int-quantized'"),
])
def test_unsupported_configs_name_their_field(plain, tmp_path, qc, quantization, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=_with_qc(plain, tmp_path, qc), quantization=quantization).create_engine_config()


def test_dummy_weights_quantize_at_load(plain):
    """--quantization gptq|awq|compressed-tensors with dummy weights: int4 in groups of 128 (awq
    asymmetric), computed by the quantized layers; a plain checkpoint is refused."""
    for q, zeros in (("gptq", False), ("awq", True), ("compressed-tensors", False)):
        llm = LLM(plain, load_format="dummy", quantization=q, kv_cache_memory="16MiB", max_model_len=256)
        worker = llm.llm_engine.executor.worker
        down = worker.model.model.layers[0].mlp.down_proj
        assert down.qweight.shape == (512 // 8, 256) and down.scales.shape == (512 // 128, 256)
        assert (down.zeros is not None) == zeros
        assert worker.precision["weights"].startswith("int4 weight-only (group 128")
        assert len(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 10
    with pytest.raises(ValueError, match="needs a gptq checkpoint"):
        EngineArgs(model=plain, quantization="gptq").create_engine_config()
