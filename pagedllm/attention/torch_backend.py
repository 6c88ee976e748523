"""Reference attention backend in plain PyTorch (CPU and GPU): gathers each request's K/V
through its block table and calls scaled_dot_product_attention. Decodes run as one padded
batch; prefill chunks run one request at a time with a causal mask offset by the cached
prefix length."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, ForwardBatch


def store_kv_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    n, bs, h, d = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of every scheduled query over its request's paged context (already stored)."""
    _, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    out = torch.empty_like(q)
    nd = batch.num_decodes
    gqa = hq != hkv
    if nd > 0:
        max_len = max(batch.seq_lens_cpu[:nd])
        nblk = (max_len + bs - 1) // bs
        bt = batch.block_tables[:nd, :nblk].long()  # [nd, nblk]
        kd = k_cache[bt].reshape(nd, nblk * bs, hkv, d)[:, :max_len].transpose(1, 2)
        vd = v_cache[bt].reshape(nd, nblk * bs, hkv, d)[:, :max_len].transpose(1, 2)
        lens = batch.seq_lens[:nd].to(q.device).long()
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [nd, L]
        qd = q[:nd].unsqueeze(2)  # [nd, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa
        )
        out[:nd] = o.squeeze(2)
    start = nd  # decodes hold one token each
    for i in range(nd, batch.num_reqs):
        qlen, slen = batch.query_lens_cpu[i], batch.seq_lens_cpu[i]
        nblk = (slen + bs - 1) // bs
        bt = batch.block_tables[i, :nblk].long()
        kc = k_cache[bt].reshape(nblk * bs, hkv, d)[:slen].transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        vc = v_cache[bt].reshape(nblk * bs, hkv, d)[:slen].transpose(0, 1).to(q.dtype)
        qi = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
        ctx = slen - qlen
        if ctx == 0:
            o = F.scaled_dot_product_attention(qi, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # query j sits at position ctx + j and sees keys 0 .. ctx + j
            qpos = torch.arange(qlen, device=q.device)[:, None] + ctx
            mask = torch.arange(slen, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qi, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
        store_kv_torch(k, v, k_cache, v_cache, batch.slot_mapping)
        return paged_attention_torch(q, k_cache, v_cache, batch, scale)
