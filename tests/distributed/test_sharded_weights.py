"""Each rank loads only its shard of a safetensors checkpoint, and the shards put together are
the checkpoint: q/k/v heads split (a KV head replicated when there are fewer than ranks),
gate/up split side by side, o/down split by input columns, the vocabulary split by rows and
padded with zeros. No processes: ranks are built one after another."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_models import save_tiny_model, tiny_config
from pagedllm.config import EngineArgs
from pagedllm.distributed import ParallelState
from pagedllm.model.layers.embedding import ParallelLMHead
from pagedllm.model.loader import CheckpointSlice, build_model, iter_safetensors


def checkpoint(path: str) -> dict[str, torch.Tensor]:
    return {name: t.load() for name, t in iter_safetensors(path)}


def shards(path: str, tp: int) -> list[torch.nn.Module]:
    mc = EngineArgs(model=path).create_engine_config().model_config
    return [build_model(mc, "cpu", ParallelState(tp_rank=r, tp_size=tp)) for r in range(tp)]


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_shards_reassemble_the_checkpoint(tmp_path, tokenizer_dir, tp, kv_heads):
    path = save_tiny_model(tiny_config("qwen2", heads=4, kv_heads=kv_heads, layers=1), str(tmp_path), tokenizer_dir)
    ckpt = checkpoint(path)
    ranks = shards(path, tp)
    d = 16
    pre = "model.layers.0"
    attn = [m.model.layers[0].self_attn for m in ranks]
    q_rows, kv_rows = 4 // tp * d, max(1, kv_heads // tp) * d
    for r, a in enumerate(attn):
        assert a.qkv_proj.weight.shape == (q_rows + 2 * kv_rows, 64)
        assert a.num_kv_heads * d == kv_rows
    # q: one block per rank, in rank order
    q = torch.cat([a.qkv_proj.weight[:q_rows] for a in attn])
    assert torch.equal(q, ckpt[f"{pre}.self_attn.q_proj.weight"])
    # k, v and their biases: rank r holds KV head r // (tp / kv_heads) when replicated
    per_head = max(1, tp // kv_heads)
    for name, lo in (("k", q_rows), ("v", q_rows + kv_rows)):
        full_w = ckpt[f"{pre}.self_attn.{name}_proj.weight"]
        full_b = ckpt[f"{pre}.self_attn.{name}_proj.bias"]
        for r, a in enumerate(attn):
            block = r // per_head
            assert torch.equal(a.qkv_proj.weight[lo : lo + kv_rows], full_w[block * kv_rows : (block + 1) * kv_rows])
            assert torch.equal(a.qkv_proj.bias[lo : lo + kv_rows], full_b[block * kv_rows : (block + 1) * kv_rows])
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), ckpt[f"{pre}.self_attn.o_proj.weight"])
    mlps = [m.model.layers[0].mlp for m in ranks]
    inter = 128 // tp
    assert torch.equal(torch.cat([m.gate_up_proj.weight[:inter] for m in mlps]), ckpt[f"{pre}.mlp.gate_proj.weight"])
    assert torch.equal(torch.cat([m.gate_up_proj.weight[inter:] for m in mlps]), ckpt[f"{pre}.mlp.up_proj.weight"])
    assert torch.equal(torch.cat([m.down_proj.weight for m in mlps], dim=1), ckpt[f"{pre}.mlp.down_proj.weight"])
    for m in ranks:  # replicated
        assert torch.equal(m.model.norm.weight, ckpt["model.norm.weight"])
    emb = torch.cat([m.model.embed_tokens.weight for m in ranks])
    assert torch.equal(emb, ckpt["model.embed_tokens.weight"])
    assert torch.equal(torch.cat([m.lm_head.weight for m in ranks]), ckpt["lm_head.weight"])
    # a rank holds about 1/tp of the big matrices, never the whole model
    full = sum(t.numel() for t in ckpt.values())
    assert all(sum(p.numel() for p in m.parameters()) < full / tp * 1.2 for m in ranks)


def test_checkpoint_slice_reads_parts(tmp_path, tokenizer_dir):
    path = save_tiny_model(tiny_config("llama", layers=1), str(tmp_path), tokenizer_dir)
    for name, sl in iter_safetensors(path):
        assert isinstance(sl, CheckpointSlice)
        full = sl.load()
        assert tuple(full.shape) == tuple(sl.shape)
        if full.dim() == 2:
            assert torch.equal(sl.narrow(1, 3, 5), full[:, 3:8])
        assert torch.equal(sl.narrow(0, 1, 2), full[1:3])
        with pytest.raises(ValueError, match="outside"):
            sl.narrow(0, full.shape[0] - 1, 2)


class _Work:
    def wait(self) -> None:
        pass


class _LocalGroup:
    """Collectives of one rank seen alone: the test sums / concatenates the ranks itself."""

    def allreduce(self, tensors):
        return _Work()


@pytest.mark.parametrize("tp", [3, 4])
def test_vocab_parallel_padding_and_mask(tp):
    vocab, hidden = 10, 4
    full = torch.randn(vocab, hidden)
    ranks = [ParallelLMHead(vocab, hidden, ParallelState(r, tp, _LocalGroup())) for r in range(tp)]
    per_rank = -(-vocab // tp)
    for head in ranks:
        head.weight_loader(head.weight, full)
        assert head.weight.shape == (per_rank, hidden)
    padded = torch.cat([h.weight for h in ranks])
    assert torch.equal(padded[:vocab], full) and not padded[vocab:].any()
    ids = torch.tensor([0, 9, 3, 8, 5, 1])
    # every id is embedded by exactly one rank; the others contribute zeros
    summed = sum(h(ids) for h in ranks)
    assert torch.equal(summed, F.embedding(ids, full))
    x = torch.randn(2, hidden)
    logits = torch.cat([F.linear(x, h.weight) for h in ranks], dim=-1)[:, :vocab]
    assert torch.allclose(logits, x @ full.T)


def test_shapes_that_do_not_split_are_refused():
    from pagedllm.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        QKVParallelLinear(64, 16, 6, 3, ps=ParallelState(0, 2))
    with pytest.raises(ValueError, match="multiple of the model's num_key_value_heads=2"):
        QKVParallelLinear(64, 16, 6, 2, ps=ParallelState(0, 3))
    with pytest.raises(ValueError, match="does not split"):
        MergedColumnParallelLinear(64, [10, 10], ps=ParallelState(0, 4))
