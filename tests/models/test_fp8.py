"""FP8 on the CPU (emulated through torch's float8 dtypes): greedy tokens of FP8-weight models
equal transformers' on the same weights dequantized (online quantization; `quant_method: fp8`
block-wise 128x128 `weight_scale_inv` checkpoints; compressed-tensors per-channel and
per-tensor), scales sharded with their weights at tensor_parallel_size 2 and 4, the options'
validation, and the norms and gated activation handing the W8A8 products their FP8 rows. The FP8
KV cache: test_fp8_kv.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import save_tiny_model, tiny_config
from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.distributed import ParallelState
from pagedllm.kernels.fp8 import FP8_MAX, dequantize_fp8_torch, quantize_fp8_torch
from pagedllm.model.loader import build_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 77, 300, 12, 9000, 41], list(range(100, 137))]


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{p}." in name for p in LINEARS)


def block_quantize(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """As the Qwen3-FP8 / DeepSeek checkpoints: e4m3 weight and one scale per b x b block."""
    n, k = w.shape
    nb, kb = -(-n // b), -(-k // b)
    wp = torch.nn.functional.pad(w.float(), (0, kb * b - k, 0, nb * b - n)).view(nb, b, kb, b)
    scale = (wp.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb, kb]
    q = (wp / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * b, kb * b)[:n, :k].contiguous(), scale


def block_dequantize(q: torch.Tensor, scale: torch.Tensor, b: int = 128) -> torch.Tensor:
    full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


def write_fp8_checkpoint(src: str, dst: str, fmt: str) -> str:
    """An FP8 checkpoint of `src` in `dst` ("block", "ct-channel" or "ct-tensor") and, in
    dst + "-ref", the plain checkpoint of the dequantized weights (the HF reference)."""
    sd = load_file(os.path.join(src, "model.safetensors"))
    out, ref = {}, {}
    for name, w in sd.items():
        if not _is_linear(name):
            out[name] = ref[name] = w
            continue
        base = name[: -len("weight")]
        if fmt == "block":
            q, s = block_quantize(w)
            out[base + "weight_scale_inv"], deq = s, block_dequantize(q, s)
        elif fmt == "ct-channel":
            q, s = quantize_fp8_torch(w)
            out[base + "weight_scale"], deq = s, dequantize_fp8_torch(q, s, torch.float32)
        else:  # ct-tensor: one scale for the whole tensor
            s = (w.abs().max() / FP8_MAX).reshape(1)
            q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[base + "weight_scale"], deq = s, q.float() * s
        out[name], ref[name] = q, deq
    for d, tensors in ((dst, out), (dst + "-ref", ref)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors":
                shutil.copy(os.path.join(src, f), d)
        save_file(tensors, os.path.join(d, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as fh:
        cfg = json.load(fh)
    if fmt == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    else:
        strategy = fmt.split("-")[1]
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }},
        }
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


def ours(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def save_plain(tmp_path_factory, tokenizer_dir) -> str:
    """The tiny llama of these tests (and test_fp8_kv.py's)."""
    # two 128-wide K blocks in every projection; q 256 rows, k/v 128 rows each
    cfg = tiny_config("llama", hidden=256, heads=4, kv_heads=2, layers=2, initializer_range=0.05)
    return save_tiny_model(cfg, str(tmp_path_factory.mktemp("plain")), tokenizer_dir, seed=3)


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tokenizer_dir) -> str:
    return save_plain(tmp_path_factory, tokenizer_dir)


@pytest.fixture(scope="module", params=["block", "ct-channel", "ct-tensor"])
def fp8_checkpoint(request, plain, tmp_path_factory) -> tuple[str, str]:
    dst = write_fp8_checkpoint(plain, str(tmp_path_factory.mktemp(request.param) / "ckpt"), request.param)
    return dst, dst + "-ref"


def test_online_fp8_equals_hf_on_dequantized_weights(plain, tmp_path):
    # online FP8 quantizes the linears and the untied LM head (one scale per vocabulary row)
    sd = load_file(os.path.join(plain, "model.safetensors"))
    ref = {n: (dequantize_fp8_torch(*quantize_fp8_torch(w), torch.float32)
               if _is_linear(n) or n == "lm_head.weight" else w)
           for n, w in sd.items()}
    shutil.copytree(plain, tmp_path / "ref")
    save_file(ref, str(tmp_path / "ref" / "model.safetensors"))
    expected = hf_greedy(str(tmp_path / "ref"), PROMPTS)
    llm = LLM(plain, kv_cache_memory="16MiB", max_model_len=256, quantization="fp8")
    worker = llm.llm_engine.executor.worker
    head = worker.model.lm_head
    assert head.weight.dtype == torch.float8_e4m3fn and head.weight_scale.shape == (head.weight.shape[0], 1)
    assert worker.model.model.embed_tokens.weight.dtype == torch.float32  # the row lookup stays
    assert worker.precision["lm_head"].startswith("fp8")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert ours(plain) != expected, "the quantization should change this model's greedy tokens"


def test_online_fp8_keeps_a_tied_head_unquantized(tmp_path, tokenizer_dir):
    cfg = tiny_config("llama", hidden=256, heads=4, kv_heads=2, layers=2, initializer_range=0.05, tie=True)
    path = save_tiny_model(cfg, str(tmp_path / "tied"), tokenizer_dir, seed=3)
    worker = LLM(path, kv_cache_memory="16MiB", max_model_len=256, quantization="fp8").llm_engine.executor.worker
    model = worker.model
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.quant_method is None
    assert worker.precision["lm_head"] == "float32"


def test_fp8_checkpoint_equals_hf_on_dequantized_weights(fp8_checkpoint):
    path, ref = fp8_checkpoint
    llm = LLM(path, kv_cache_memory="16MiB", max_model_len=256)
    qkv = llm.llm_engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    assert qkv.weight_scale.shape == (512, 2 if "block" in path else 1)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(ref, PROMPTS)


def _dequantized(layer) -> torch.Tensor:
    return dequantize_fp8_torch(layer.weight.data, layer.weight_scale.data, torch.float32)


@pytest.mark.parametrize("tp", [2, 4])
def test_scales_shard_with_their_weights(fp8_checkpoint, tp):
    """Each rank's dequantized projections are its slices of the whole model's."""
    path, _ = fp8_checkpoint
    if "block" in path and tp == 4:
        pytest.skip("o_proj's 256 input columns do not split into 128-wide blocks over 4 ranks (refused below)")
    mc = EngineArgs(model=path, tensor_parallel_size=1).create_engine_config().model_config
    full = build_model(mc, "cpu").model.layers[1]
    ranks = [build_model(mc, "cpu", ParallelState(tp_rank=r, tp_size=tp)).model.layers[1] for r in range(tp)]
    fq, fk, fv = _dequantized(full.self_attn.qkv_proj).split([256, 128, 128])
    fg, fu = _dequantized(full.mlp.gate_up_proj).chunk(2)
    kv_rows = 128 // min(tp, 2)  # 2 kv heads: replicated on ranks beyond 2
    for r, layer in enumerate(ranks):
        q, k, v = _dequantized(layer.self_attn.qkv_proj).split([256 // tp, kv_rows, kv_rows])
        kr = r // max(1, tp // 2)
        assert torch.equal(q, fq.chunk(tp)[r]) and torch.equal(k, fk.chunk(min(tp, 2))[kr])
        assert torch.equal(v, fv.chunk(min(tp, 2))[kr])
        g, u = _dequantized(layer.mlp.gate_up_proj).chunk(2)
        assert torch.equal(g, fg.chunk(tp)[r]) and torch.equal(u, fu.chunk(tp)[r])
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            mine, whole = layer.get_submodule(name), full.get_submodule(name)
            assert torch.equal(_dequantized(mine), _dequantized(whole).chunk(tp, dim=1)[r]), name


def test_block_checkpoint_refuses_a_split_inside_a_block(fp8_checkpoint):
    path, _ = fp8_checkpoint
    if "block" not in path:
        pytest.skip("block-wise only")
    mc = EngineArgs(model=path).create_engine_config().model_config
    with pytest.raises(ValueError, match="tensor_parallel_size=4 .*128-wide scale blocks"):
        build_model(mc, "cpu", ParallelState(tp_rank=0, tp_size=4)).model.layers[0]
    build_model(mc, "cpu", ParallelState(tp_rank=0, tp_size=2))


# ------------------------------------------------------------------------------ validation


def test_bad_options_name_their_field(plain):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model=plain, quantization="int3").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model=plain, kv_cache_dtype="fp4").create_engine_config()
    with pytest.raises(ValueError, match="compressed-tensors checkpoint"):
        EngineArgs(model=plain, quantization="compressed-tensors").create_engine_config()


def test_cli_flags():
    from pagedllm.entrypoints.cli import build_parser, engine_args_from_namespace

    ns = build_parser().parse_args(["serve", "m", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    args = engine_args_from_namespace(ns)
    assert (args.quantization, args.kv_cache_dtype) == ("fp8", "fp8")


def test_fp8_rows_reach_the_w8a8_products(plain, monkeypatch):
    """Where a layer multiplies per-token FP8 rows (W8A8: CUDA from 64 rows; here the CPU is told
    so, and its `torch._scaled_mm` multiplies), the norms hand the qkv and gate/up products their
    rows already quantized and the gated activation the down product's (`norm_into`, `act_into`);
    the o projection quantizes its own. The greedy tokens equal those of quantizing before every
    product (PAGEDLLM_FUSED_NORM_FP8=0, PAGEDLLM_FUSED_ACT_FP8=0), and decode steps (below 64
    rows) take 16-bit rows."""
    from pagedllm.kernels.fp8 import Fp8Rows, fp8_linear, fp8_rows
    from pagedllm.model.layers.quantization.fp8 import Fp8LinearMethod

    names: dict[int, str] = {}
    got: list[tuple[str, int, bool]] = []  # (product, rows, handed FP8 rows by the kernel before)

    def takes(self, layer, x):
        return x.shape[0] >= 64

    def apply(self, layer, x, bias):
        handed = isinstance(x, Fp8Rows)
        if not handed and takes(self, layer, x):  # the unfused W8A8: quantized here
            x = fp8_rows(x)
        if isinstance(x, Fp8Rows):
            got.append((names[id(layer)].rsplit(".", 1)[-1], x.data.shape[0], handed))
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_rows", takes)
    monkeypatch.setattr(Fp8LinearMethod, "apply", apply)
    prompts = [list(range(200, 300)), [5, 77, 300]]
    outs, seen = {}, {}
    for fused in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_FUSED_NORM_FP8", fused)
        monkeypatch.setenv("PAGEDLLM_FUSED_ACT_FP8", fused)
        llm = LLM(plain, kv_cache_memory="16MiB", max_model_len=256, quantization="fp8", dtype="bfloat16",
                  max_num_batched_tokens=128)
        model = llm.llm_engine.executor.worker.model
        names.update({id(m): n for n, m in model.named_modules()
                      if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)})
        got.clear()
        outs[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        seen[fused] = sorted(set(got))
    assert outs["1"] == outs["0"]
    products = ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    # one step of 103 rows (both prompts' prefills); 2 layers: each product twice
    assert seen["0"] == [(p, 103, False) for p in products]
    assert seen["1"] == [(p, 103, p != "o_proj") for p in products]
    assert sum(1 for p, _, handed in got if handed) == 2 * 3
