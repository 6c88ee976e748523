"""Pipeline parallelism on the CPU (gloo, one process per rank): PP=2, PP=3 and TP=2 x PP=2
give the token ids of TP=1 exactly in float32 on tiny Llama and Qwen3 models (tied embeddings
included) through the offline LLM: mixed batches, chunked prefill, prefix-cache hits, seeded
sampling, logprobs. Each stage loads only its layers; a killed stage is a RuntimeError naming
it, and no process is left behind.

A Qwen3-MoE model split over two stages gives its single engine's tokens too. Long
combinations are behind `extended` (PP=2 on Qwen3, run by the server test; PP=3 on Llama;
TP=2 x PP=2 on Qwen3)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tiny_models import save_tiny_model, tiny_config
from pagedllm import SamplingParams
from tp_utils import engine, one_thread, process_gone, prompts_of, token_ids

pytestmark = pytest.mark.timeout(300)

MODELS = {
    "llama": ("llama", dict(layers=4, heads=4, kv_heads=2)),
    # 3 layers: PP=2 splits them 2 | 1; tied embeddings: the last stage loads its LM head from
    # the embedding it does not hold
    "qwen3": ("qwen3", dict(layers=3, tie=True, heads=4, kv_heads=2, head_dim=16)),
}
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=48, block_size=8)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=10, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    return {name: save_tiny_model(tiny_config(arch, **kw), str(tmp_path_factory.mktemp(name)), tokenizer_dir, seed=1)
            for name, (arch, kw) in MODELS.items()}


def run_workload(llm) -> dict:
    shared = prompts_of([40], seed=7)[0]
    out = {
        "batch": token_ids(llm, prompts_of([1, 5, 17, 33, 64, 100, 2], seed=1)),
        "prefix": token_ids(llm, [shared + t for t in prompts_of([3, 11, 20], seed=8)]),
        "seeded": token_ids(llm, prompts_of([9, 30], seed=2), SEEDED),
    }
    lp = llm.generate(prompts_of([15], seed=3), LOGPROBS, use_tqdm=False)[0]
    out["logprobs"] = [sorted((t, round(v.logprob, 4)) for t, v in d.items()) for d in lp.outputs[0].logprobs]
    out["prompt_logprobs"] = [sorted(d) for d in lp.prompt_logprobs[1:]]
    return out


@pytest.fixture(scope="module")
def references(paths) -> dict[str, dict]:
    refs = {}
    with one_thread():
        for name, path in paths.items():
            with engine(path, **ENGINE) as llm:
                refs[name] = run_workload(llm)
    return refs


def check_equal(got: dict, ref: dict) -> None:
    for key in ("batch", "prefix", "seeded", "prompt_logprobs"):
        assert got[key] == ref[key], key
    for a, b in zip(got["logprobs"], ref["logprobs"]):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(a, b))


CASES = [
    # vLLM's variable moves Llama's split to 3 | 1 (the default would be 2 | 2)
    pytest.param("llama", 1, 2, "3,1", id="llama-pp2-split31"),
    pytest.param("qwen3", 1, 3, None, id="qwen3-pp3"),
    pytest.param("llama", 2, 2, None, id="llama-tp2xpp2"),
    pytest.param("qwen3", 1, 2, None, id="qwen3-pp2", marks=pytest.mark.extended),  # the server test runs it
    pytest.param("llama", 1, 3, None, id="llama-pp3", marks=pytest.mark.extended),
    pytest.param("qwen3", 2, 2, None, id="qwen3-tp2xpp2", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("model,tp,pp,split", CASES)
def test_pipeline_matches_tp1(paths, references, monkeypatch, model, tp, pp, split):
    if split is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", split)
    with engine(paths[model], tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE) as llm:
        pc = llm.llm_engine.config.parallel_config
        assert pc.distributed_executor_backend == "mp" and pc.world_size == tp * pp
        if split is not None:
            assert pc.pp_layer_partition == tuple(int(x) for x in split.split(","))
        assert len(llm.llm_engine.executor.worker_pids) == tp * pp - 1
        got = run_workload(llm)
        stats = llm.llm_engine.get_stats()
    check_equal(got, references[model])
    assert stats.prefix_cache_hits >= 40
    assert stats.num_free_blocks == stats.num_gpu_blocks  # every block back in the pool


def test_moe_pipeline_matches_pp1(tmp_path, tokenizer_dir):
    """Qwen3-MoE (layer 0 dense, layers 1-2 sparse) split 2 | 1: the stages load only their
    experts, and the tokens are the single engine's."""
    from moe_utils import save_moe_model, tiny_moe_config

    path, _ = save_moe_model(tiny_moe_config("qwen3_moe"), str(tmp_path / "moe"), tokenizer_dir)
    prompts = prompts_of([1, 5, 17, 33, 64, 2], seed=1)
    with engine(path, **ENGINE) as llm:
        ref = token_ids(llm, prompts)
    with engine(path, pipeline_parallel_size=2, **ENGINE) as llm:
        assert llm.llm_engine.config.parallel_config.pp_layer_partition == (2, 1)
        assert token_ids(llm, prompts) == ref


def test_bad_layer_partition_is_refused(paths, monkeypatch):
    from pagedllm.config import EngineArgs

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION='2,1' sums to 3; the model has 4 layers"):
        EngineArgs(model=paths["llama"], pipeline_parallel_size=2, **ENGINE).create_engine_config()
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is larger than the model's num_hidden_layers=4"):
        EngineArgs(model=paths["llama"], pipeline_parallel_size=5, **ENGINE).create_engine_config()


@pytest.mark.parametrize("stage,layers", [(0, {0, 1}), (1, {2, 3})])
def test_each_stage_loads_only_its_layers(paths, stage, layers):
    """In one process, no group needed: the stage's model has its layers' parameters only, the
    embedding on the first stage, norm and LM head on the last, and loads from the checkpoint."""
    from pagedllm.config import EngineArgs
    from pagedllm.distributed import ParallelState
    from pagedllm.model.loader import build_model

    cfg = EngineArgs(model=paths["llama"], pipeline_parallel_size=2, **ENGINE).create_engine_config()
    ps = ParallelState(pp_rank=stage, pp_size=2, layer_range=(2 * stage, 2 * stage + 2))
    model = build_model(cfg.model_config, "cpu", ps)
    names = {n for n, _ in model.named_parameters()}
    assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == layers
    assert any("embed_tokens" in n for n in names) == (stage == 0)
    assert ("lm_head.weight" in names) == (stage == 1) and ("model.norm.weight" in names) == (stage == 1)


def test_killed_stage_is_a_clear_error_and_a_clean_exit(paths):
    with engine(paths["qwen3"], pipeline_parallel_size=2, **ENGINE) as llm:
        ex = llm.llm_engine.executor
        pids = list(ex.worker_pids)
        assert token_ids(llm, prompts_of([4], seed=1))  # serving
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"rank 1 \(pipeline stage 1, tensor-parallel rank 0\).*SIGKILL"):
            token_ids(llm, prompts_of([4, 9], seed=2))
        with pytest.raises(RuntimeError, match="pipeline stage 1"):  # and it stays failed
            llm.llm_engine.check_health()
    deadline = time.monotonic() + 10
    while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(process_gone(p) for p in pids)
