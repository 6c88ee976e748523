"""Gemma 2, Gemma 3, Phi-3, GPT-2, StarCoder2, OLMo 2, GLM-4, Granite and GPT-NeoX from GGUF
files, and the first three as dummy weights. GGUF: a tiny random HF model written as llama.cpp's
converter writes it (tests/gguf_writer.py), loaded by pagedllm: greedy token ids equal
- Gemma / Phi-3: transformers' run of the original weights under the config transformers reads
  from that file (its GGUF loader itself drops Gemma's untied output.weight: no reference);
- GPT-2, StarCoder2: transformers' own load of the GGUF file (config and weights);
- OLMo 2, GLM-4, Granite, GPT-NeoX (transformers reads no GGUF of theirs): the original model
  the file was written from."""

from __future__ import annotations

import os

import pytest
import torch

from arch_configs import arch_config
from tiny_models import copy_tokenizer, save_tiny_model
from pagedllm import LLM, SamplingParams
from test_archs_equivalence import ENGINE, _config, save_model
from test_hf_equivalence import check, prompts_of

gguf = pytest.importorskip("gguf")
from gguf_writer import write_gguf  # noqa: E402

# the architectures transformers' GGUF reader maps (the rest: pagedllm builds their configs from
# the file's metadata, pagedllm/model/gguf_config.py)
TRANSFORMERS_READS = ("gpt2", "starcoder2")


def _write(hf_dir: str, path: str) -> None:
    from transformers import AutoModelForCausalLM

    write_gguf(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), path)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_gguf_equals_transformers_gguf_loader(name, tmp_path, tokenizer_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir = save_model(_config(name), str(tmp_path / "hf"), tokenizer_dir)
    path = str(tmp_path / f"{name}.gguf")
    _write(hf_dir, path)
    cfg = AutoConfig.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.load_state_dict(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict())
    llm = LLM(path, tokenizer=tokenizer_dir, **ENGINE)
    assert llm.llm_engine.config.model_config.architecture == type(hf).__name__
    check(llm, hf, prompts_of([7, 40, 70], seed=1))


@pytest.mark.parametrize("name", ["gpt2", "starcoder2", "olmo2", "glm4", "granite", "gpt_neox"])
def test_more_architectures_from_gguf(name, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    cfg = arch_config(name)
    if name == "gpt2":  # transformers' GGUF reader gives GPT-2 the default 1024 positions (it sets n_ctx)
        cfg.n_positions = 1024
    hf_dir = save_tiny_model(cfg, str(tmp_path / "hf"), tokenizer_dir, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(hf, path)
    if name in TRANSFORMERS_READS:
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
    llm = LLM(path, tokenizer=tokenizer_dir, **ENGINE)
    assert llm.llm_engine.config.model_config.architecture == type(hf).__name__
    check(llm, hf, prompts_of([7, 40, 70], seed=1))


@pytest.mark.parametrize("name", ["phi3-longrope-window", "phi-4-mini"])
def test_phi3_gguf_keeps_window_partial_rotary_and_longrope(name, tmp_path, tokenizer_dir):
    """What llama.cpp's converter writes of Phi-3 and transformers' GGUF reader drops (the
    sliding window, rope.dimension_count, the rope_factors_long / _short tensors): pagedllm
    reads them back, so the file's model equals the one it was written from. Phi-3 with a
    24-token window and LongRoPE from an original 64 (prompts past it: long factors), and the
    shrunk published Phi-4-mini (rotary over 3/4 of each head, short factors at these lengths)."""
    from transformers import AutoModelForCausalLM

    from held_out_configs import PHI_4_MINI, shrink
    from test_held_out_configs import write_model

    if name == "phi-4-mini":
        hf_dir = write_model(shrink(PHI_4_MINI), str(tmp_path / "hf"), tokenizer_dir)
        prompts = [[t % 4096 for t in p] for p in prompts_of([7, 40, 70], seed=1)]
    else:
        hf_dir = save_model(_config(name), str(tmp_path / "hf"), tokenizer_dir)
        prompts = prompts_of([65, 100, 81], seed=1)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(hf, path)
    llm = LLM(path, tokenizer=tokenizer_dir, **ENGINE)
    check(llm, hf, prompts)
    assert llm.llm_engine.config.model_config.hf_config.rope_parameters["rope_type"] == "longrope"


_EXT = pytest.mark.extended


@pytest.mark.parametrize("name", ["gpt_neox", "granite", "phi-4-mini", "gemma2", pytest.param("gpt2", marks=_EXT),
                                  pytest.param("glm4", marks=_EXT), pytest.param("olmo2", marks=_EXT),
                                  pytest.param("starcoder2", marks=_EXT), pytest.param("gemma3", marks=_EXT),
                                  pytest.param("phi3", marks=_EXT)])
def test_quantized_blocks_equal_the_dequantized_file(name, tmp_path, tokenizer_dir, monkeypatch):
    """A Q8_0 GGUF file served from its blocks (the CPU default) gives the tokens and, within
    1e-4 (relative below -1), the prompt logprobs of the same file dequantized at load
    (quantization="none"):
    the fused q|k|v rows of GPT-2 / GPT-NeoX cut as blocks, Granite's interleaved q/k rows
    undone, the partial rotary's q/k permutation (GPT-NeoX, GLM-4, Phi-4-mini) applied to
    whole block rows, Phi-3's fused tensors cut without dequantizing. (Against transformers
    a Q8_0 file's rounding may move a tiny random model's tokens; the float32 files of the
    tests above carry that comparison.) The products keep float32 activations here
    (PAGEDLLM_GGUF_INT8=0's kernel), so that the layout is checked exactly: the int8 ones
    (tests/unit/test_gguf_kernels.py) move these tiny random models' logprobs by ~2e-4."""
    from transformers import AutoModelForCausalLM

    from pagedllm.kernels import gguf_kernels

    monkeypatch.setattr(gguf_kernels, "_int8", 0)

    from held_out_configs import PHI_4_MINI, shrink
    from test_held_out_configs import write_model

    if name == "phi-4-mini":
        hf_dir = write_model(shrink(PHI_4_MINI), str(tmp_path / "hf"), tokenizer_dir)
    else:  # the families' test configs with a vocabulary of 4,096 (cheaper files and heads)
        cfg = _config(name) if name in ("gemma2", "gemma3", "phi3") else arch_config(name)
        cfg.vocab_size = 4096
        hf_dir = save_model(cfg, str(tmp_path / "hf"), tokenizer_dir)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), path, "Q8_0")
    blocks = LLM(path, tokenizer=tokenizer_dir, **ENGINE)
    assert blocks.llm_engine.executor.worker.precision["weights"] == "gguf Q8_0 (CPU kernels)"
    dense = LLM(path, tokenizer=tokenizer_dir, quantization="none", **ENGINE)
    prompts = [[t % 4096 for t in p] for p in prompts_of([7, 40, 70], seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (blocks, dense))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            (tx, px), (ty, py) = next(iter(lx.items())), next(iter(ly.items()))
            assert tx == ty and abs(px.logprob - py.logprob) < 1e-4 * max(1.0, abs(py.logprob))


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_dummy_weights(name, tmp_path, tokenizer_dir):
    """load_format="dummy" from a config alone (what the benchmarks run): every parameter is
    filled (Gemma's norms as 1 + 0), another seed gives other weights, so other tokens."""
    cfg = _config(name)
    cfg.architectures = [{"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}[name]]
    cfg.save_pretrained(str(tmp_path))
    copy_tokenizer(tokenizer_dir, tmp_path)
    prompts = prompts_of([5, 30], seed=2)
    from test_hf_equivalence import GREEDY

    runs = []
    for seed in (0, 1):
        llm = LLM(str(tmp_path), load_format="dummy", seed=seed, **ENGINE)
        model = llm.llm_engine.executor.worker.model
        assert all(torch.isfinite(p).all() for p in model.parameters())
        norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
        assert norms and all(bool((p == 1).all()) for p in norms)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert runs[0] != runs[1]
    assert all(len(t) == GREEDY.max_tokens for t in runs[0])
