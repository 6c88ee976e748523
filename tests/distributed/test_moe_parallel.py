"""Mixture-of-experts models under tensor parallelism on the CPU (gloo, a process per rank):
TP=2 (every expert sliced over both ranks) and TP=2 with expert parallelism (whole experts per
rank) give the token ids of TP=1 exactly in float32, over mixed batches, chunked prefill and
prefix-cache hits. And without processes: each rank loads only its shard of the experts, and
the shards put together are the checkpoint's experts."""

from __future__ import annotations

import pytest
import torch

from moe_utils import save_moe_model, tiny_moe_config
from pagedllm.config import EngineArgs
from pagedllm.distributed import ParallelState
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.loader import build_model, iter_safetensors
from tp_utils import engine, one_thread, prompts_of, token_ids

pytestmark = pytest.mark.timeout(300)
ENGINE = dict(kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=32, block_size=8)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def run_workload(llm) -> dict:
    shared = prompts_of([40], seed=7)[0]
    return {
        "batch": token_ids(llm, prompts_of([1, 5, 17, 33, 64, 2], seed=1)),
        "prefix": token_ids(llm, [shared + t for t in prompts_of([3, 11], seed=8)]),
    }


@pytest.mark.parametrize("arch", [
    "qwen2_moe",  # the shared expert (tensor parallel in both modes) beside the routed ones
    pytest.param("qwen3_moe", marks=pytest.mark.extended),
    pytest.param("mixtral", marks=pytest.mark.extended),
])
def test_tp2_and_expert_parallel_match_tp1(arch, tmp_path, tokenizer_dir):
    path, _ = save_moe_model(tiny_moe_config(arch), str(tmp_path), tokenizer_dir)
    with engine(path, **ENGINE) as llm:
        ref = run_workload(llm)
        ref_load = llm.llm_engine.executor.worker.model.expert_load()
    with engine(path, tensor_parallel_size=2, **ENGINE) as llm:
        assert run_workload(llm) == ref
    with engine(path, tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE) as llm:
        assert llm.llm_engine.config.parallel_config.enable_expert_parallel
        assert run_workload(llm) == ref
        stats = llm.llm_engine.get_stats()
    # rank 0 sees every routing decision: the same load as TP=1, split into the ranks' halves
    assert stats.expert_load == ref_load
    half = len(ref_load) // 2
    assert stats.expert_load_per_rank == [sum(ref_load[:half]), sum(ref_load[half:])]


def _experts_by_rank(path: str, tp: int, ep: bool) -> list[list[FusedMoE]]:
    mc = EngineArgs(model=path, tensor_parallel_size=tp, enable_expert_parallel=ep).create_engine_config().model_config
    return [[m for m in build_model(mc, "cpu", ParallelState(r, tp, enable_expert_parallel=ep)).modules()
             if isinstance(m, FusedMoE)] for r in range(tp)]


@pytest.mark.parametrize("ep", [False, True])
def test_expert_shards_reassemble_the_checkpoint(tmp_path, tokenizer_dir, ep):
    cfg = tiny_moe_config("mixtral")
    path, _ = save_moe_model(cfg, str(tmp_path), tokenizer_dir)
    ckpt = {n: t.load() for n, t in iter_safetensors(path)}
    ranks = _experts_by_rank(path, 2, ep)
    i = cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        mods = [r[layer] for r in ranks]
        if ep:  # whole experts: rank 0 holds 0, 1; rank 1 holds 2, 3
            assert [m.w13_weight.shape[0] for m in mods] == [2, 2]
            w13 = torch.cat([m.w13_weight for m in mods])
            w2 = torch.cat([m.w2_weight for m in mods])
        else:  # every expert, half of its rows each
            assert [m.w13_weight.shape[:2] for m in mods] == [(4, i), (4, i)]
            w13 = torch.cat([torch.cat([m.w13_weight[:, : i // 2] for m in mods], 1),
                             torch.cat([m.w13_weight[:, i // 2 :] for m in mods], 1)], 1)
            w2 = torch.cat([m.w2_weight for m in mods], 2)
        for e in range(4):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            assert torch.equal(w13[e], torch.cat([ckpt[f"{p}.w1.weight"], ckpt[f"{p}.w3.weight"]]))
            assert torch.equal(w2[e], ckpt[f"{p}.w2.weight"])
