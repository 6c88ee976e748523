"""Loading a model: its config (HF directory or GGUF file), its tokenizer, and its weights
from safetensors (single or sharded), GGUF (dequantized with the `gguf` package, or kept in its
blocks for quantization/gguf.py) or at random (`load_format="dummy"`, for benchmarks). Never
unpickles anything.

Under tensor parallelism each rank builds its shard of the model and reads only its part of
every safetensors tensor (`CheckpointSlice`: the layers' weight loaders narrow it before it is
read); a dequantized GGUF tensor is dequantized whole, then narrowed; a quantized one is
narrowed in its blocks."""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
from typing import Any, Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _split_gguf(path: str) -> tuple[str, str]:
    d, f = os.path.split(os.path.abspath(path))
    return d, f


def load_hf_config(model: str, load_format: str) -> tuple[Any, str | None, str]:
    """Returns (transformers config, gguf file name or None, resolved load format)."""
    from transformers import AutoConfig

    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model: {model!r} is a file but not a .gguf file")
        if load_format not in ("auto", "gguf", "dummy"):
            raise ValueError(f"load_format={load_format!r} does not fit the GGUF file {model!r}")
        from pagedllm.model.gguf_config import complete_gguf_config, gguf_only_config

        d, f = _split_gguf(model)
        cfg = gguf_only_config(model)
        if cfg is None:
            cfg = AutoConfig.from_pretrained(d, gguf_file=f)
            complete_gguf_config(model, cfg)
        if not getattr(cfg, "architectures", None):
            cfg.architectures = [_GGUF_ARCH.get(cfg.model_type, "LlamaForCausalLM")]
        if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
            from pagedllm.model.models.moe import gguf_moe_config

            gguf_moe_config(model, cfg)
        return cfg, f, "gguf" if load_format == "auto" else load_format
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model: {model!r} has no config.json")
    cfg = text_part(AutoConfig.from_pretrained(model))
    if load_format == "auto":
        load_format = "safetensors"
    if load_format == "gguf":
        raise ValueError("load_format='gguf' needs model to be a .gguf file")
    return cfg, None, load_format


# vision-language architectures whose text model is served alone: the engine sees their
# `text_config` (the model class skips the vision tower's tensors), so image inputs are not served
TEXT_PART_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


def text_part(cfg: Any) -> Any:
    """The config a vision-language checkpoint's text model is served by (its `text_config`,
    named by the checkpoint's architecture, with the top level's eos ids and dtype); any other
    config as it is."""
    archs = list(getattr(cfg, "architectures", None) or [])
    text = getattr(cfg, "text_config", None)
    if text is None or not any(a in TEXT_PART_ARCHITECTURES for a in archs):
        return cfg
    text.architectures = archs
    for key in ("eos_token_id", "dtype"):
        if getattr(cfg, key, None) is not None:
            setattr(text, key, getattr(cfg, key))
    logger.info("%s: serving the text model only (the vision tower is not loaded)", archs[0])
    return text


_GGUF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "gpt2": "GPT2LMHeadModel", "starcoder2": "Starcoder2ForCausalLM",
              "olmo2": "Olmo2ForCausalLM", "glm4": "Glm4ForCausalLM", "granite": "GraniteForCausalLM",
              "gpt_neox": "GPTNeoXForCausalLM"}


def gguf_architectures() -> set[str]:
    """The architectures a GGUF file may hold here."""
    return set(_GGUF_ARCH.values())


def load_tokenizer(model: str, tokenizer: str | None, gguf_file: str | None):
    from transformers import AutoTokenizer

    path = tokenizer or model
    if gguf_file is not None and os.path.isfile(path) and path.endswith(".gguf"):
        d, f = _split_gguf(path)
        return AutoTokenizer.from_pretrained(d, gguf_file=f)
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model: str, gguf_file: str | None, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json (it may list several), the config, the tokenizer."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)

    if gguf_file is None:
        gen = os.path.join(model, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as fh:
                add(json.load(fh).get("eos_token_id"))
    if not ids:
        add(getattr(hf_config, "eos_token_id", None))
    if not ids and tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


# ---- weights -------------------------------------------------------------------------------
class CheckpointSlice:
    """A safetensors tensor not read yet. The weight loaders use it like a tensor: `.shape`,
    `.narrow(dim, start, length)` reads that part only, `.load()` reads all of it. Valid until
    the iterator that made it moves on."""

    __slots__ = ("_slice", "name", "shape")

    def __init__(self, name: str, sl) -> None:
        self.name = name
        self._slice = sl
        self.shape = torch.Size(sl.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"{self.name}: rows [{start}, {start + length}) of dim {dim} are outside its size {size}")
        index = tuple(slice(None) for _ in range(dim)) + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        return self._slice[:] if self.shape else self._slice[()]


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, CheckpointSlice]]:
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
        files = [os.path.join(model_dir, f) for f in files]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r} (pickled checkpoints are not loaded)")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, CheckpointSlice(name, f.get_slice(name))


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # LayerNorm models
    "output.weight": "lm_head.weight",
    "position_embd.weight": "model.embed_positions",  # GPT-2's learned positions
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, the experts stacked per projection, the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


_GEMMA_GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
_GELU_MLP_GGUF_NAMES = {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# where an architecture's GGUF layer tensors differ from Llama's names (gguf's own tensor map):
# Gemma's four norms; Phi-3's and GLM-4's fused gate_up (ffn_up holds both), cut by the model;
# the norms after the blocks of OLMo 2 and GLM-4; the plain GELU MLPs; fused q | k | v rows
# (attn_qkv: Phi-3's model cuts them, GPT-2's and GPT-NeoX's are cut in iter_gguf)
_GGUF_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_GGUF_NAMES,
    "gemma3": _GEMMA_GGUF_NAMES,
    "gemma3_text": _GEMMA_GGUF_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "glm4": {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
             "ffn_up": "mlp.gate_up_proj"},
    "starcoder2": _GELU_MLP_GGUF_NAMES,
    "gpt2": {**_GELU_MLP_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj"},
    "gpt_neox": {**_GELU_MLP_GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj"},
}
_GGUF_SPLIT_QKV = ("gpt2", "gpt_neox")
# llama.cpp's converter interleaves the rotary halves of q and k for these (Llama's converter)
_GGUF_PERMUTED_ROPE = ("llama", "mistral", "granite")


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each head of q and k for
    Llama; undo it to get back HF's rotate-half layout."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(path: str, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """The file's tensors under HF names, dequantized to float32; with `keep_quantized`, those
    of a type the GGUF CPU kernels take (but the MoE experts') come as GGUFTensor blocks."""
    import gguf

    from pagedllm.kernels.gguf_kernels import QUANT_TYPES
    from pagedllm.model.layers.quantization.gguf import GGUFTensor

    reader = gguf.GGUFReader(path)
    arch = str(getattr(hf_config, "model_type", "llama"))
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(arch, {})}
    qkv_rows = [n_heads * head_dim, n_kv * head_dim, n_kv * head_dim]
    for t in reader.tensors:
        name = _GGUF_NAMES.get(t.name)
        if name is None:
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_names:
                logger.debug("skipping GGUF tensor %s", t.name)
                continue
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
        if keep_quantized and t.tensor_type.name in QUANT_TYPES and len(shape) == 2 and ".experts." not in name:
            q = GGUFTensor(name, t.tensor_type.name, t.data, shape[1])
            if arch in _GGUF_PERMUTED_ROPE and name.endswith(("q_proj.weight", "k_proj.weight")):
                rows = np.arange(shape[0]).reshape(-1, 1)
                q = q.permute_rows(_unpermute_rope(rows, n_heads if "q_proj" in name else n_kv)[:, 0])
            if arch in _GGUF_SPLIT_QKV and ".qkv_proj." in name:  # whole rows of blocks: cut as they are
                start = 0
                for part, n in zip("qkv", qkv_rows):
                    yield name.replace(".qkv_proj.", f".{part}_proj."), q.narrow(0, start, n)
                    start += n
                continue
            yield name, q
            continue
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        data = np.array(data, dtype=np.float32, copy=True).reshape(shape)
        if arch in _GGUF_PERMUTED_ROPE and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj"):
            data = _unpermute_rope(data, n_heads if "q_proj" in name else n_kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w; back to HF's w
        tensor = torch.from_numpy(np.ascontiguousarray(data))
        if arch in _GGUF_SPLIT_QKV and ".qkv_proj." in name:
            for part, block in zip("qkv", tensor.split(qkv_rows)):
                yield name.replace(".qkv_proj.", f".{part}_proj."), block
            continue
        yield name, tensor


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights, drawn on the parameters' own device (fast for an 8B model on a GPU)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.data.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.normal_(0.0, std, generator=gen)


def build_model(model_config, device: str, ps=None) -> torch.nn.Module:
    """Construct the model on `device` in the configured dtype and fill its weights."""
    from pagedllm.distributed import SINGLE
    from pagedllm.model.registry import get_model_class

    cls = get_model_class(model_config.architecture)
    dtype = torch_dtype(model_config.dtype)
    # the model's own copy of the config, told the engine's max_model_len (rotary caches are
    # sized by it; it picks LongRoPE's factors and dynamic NTK's base)
    hf_config = copy.copy(model_config.hf_config)
    hf_config.pagedllm_max_model_len = model_config.max_model_len
    with _default_dtype(dtype), torch.device(device):
        model = cls(hf_config, ps or SINGLE)
        quant = getattr(model_config, "quantization", None)
        if quant is not None:
            from pagedllm.model.layers.quantization import quantize_model

            quantize_model(model, quant)
    # (rotary cos/sin caches are built in float32 explicitly, whatever the default dtype)
    fmt = model_config.load_format
    if fmt == "dummy":
        init_dummy_weights(model, model_config.seed,
                           float(getattr(model_config.hf_config, "initializer_range", 0.02)))
    else:
        weights = (
            iter_gguf(model_config.model, model_config.hf_config, getattr(quant, "name", None) == "gguf")
            if fmt == "gguf"
            else iter_safetensors(model_config.model)
        )
        loaded = model.load_weights(weights)
        expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"model: checkpoint lacks weights for {sorted(missing)[:5]} ...")
    if quant is not None:
        from pagedllm.model.layers.quantization import process_weights_after_loading

        process_weights_after_loading(model)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        use_column_major_weights(model)
        from pagedllm.kernels import cpu_gemm

        cpu_gemm.pack_linear_weights(model)
    return model.eval()


def use_column_major_weights(model: torch.nn.Module) -> None:
    """Store every 2-D projection weight column-major (the same [out, in] tensor with strides
    (1, out)) so that `F.linear` hands MKL's sgemm an untransposed right operand. On the CPU
    this takes 1.3-2x less time per step at the decode batch sizes of 2 to 48 rows (SmolLM2's
    projections, float32, benchmarks/RESULTS.md); one row runs as fast either way. The
    embedding lookup reads strided rows then, which costs little for a step's few tokens."""
    seen: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        if param.dim() != 2 or id(param) in seen or not param.is_contiguous() or param.dtype != torch.float32:
            continue
        seen.add(id(param))
        param.data = param.data.t().contiguous().t()
