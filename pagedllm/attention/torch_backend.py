"""Reference attention backend in plain PyTorch (CPU and GPU): gathers each request's K/V
through its block table and calls scaled_dot_product_attention. Decodes run as one padded
batch; prefill chunks run one request at a time with a causal mask offset by the cached
prefix length.

Two per-layer options (both None in the plain case, which then runs exactly as before):
- `sliding_window` W: the query at position p sees keys p - W + 1 .. p (HF's and Mistral's
  window: W tokens, itself included);
- `logits_soft_cap` c: scores become c * tanh(scores / c) before the mask and the softmax
  (Gemma 2); SDPA cannot do that, so those layers run the same steps written out (`_attend`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, ForwardBatch


def store_kv_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    all_valid: bool | None = None,  # known already: no -1 in slot_mapping
    k_scale: float = 1.0,  # FP8 caches: stored = value / scale, saturated to the format's range
    v_scale: float = 1.0,
) -> None:
    if all_valid is None:
        all_valid = bool((slot_mapping >= 0).all())
    if not all_valid:
        valid = slot_mapping >= 0
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    if k_cache.dtype.itemsize == 1:
        # FP8: index_copy_ has no float8 kernel on the CPU; the bytes are copied instead
        top = float(torch.finfo(k_cache.dtype).max)
        # (multiplied by the inverse, as the Triton store does: the same bytes)
        k = (k.float() * (1.0 / k_scale)).clamp(-top, top).to(k_cache.dtype).view(torch.uint8)
        # a NaN in V is stored as 0: the Triton kernels read whole V blocks (attention/backend.py)
        v = v.float()
        v = (v.masked_fill(v.isnan(), 0.0) * (1.0 / v_scale)).clamp(-top, top).to(v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    elif not v_cache.is_contiguous():  # key-major 16-bit V: what the kernels' finite_v stores
        top = float(torch.finfo(v_cache.dtype).max)
        v = v.float()
        v = v.masked_fill(v.isnan(), 0.0).clamp(-top, top)
    _store_rows(k_cache, slot_mapping, k.to(k_cache.dtype))
    _store_rows(v_cache, slot_mapping, v.to(v_cache.dtype))


def _store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    n, bs, h, d = cache.shape
    if cache.is_contiguous():
        cache.view(n * bs, h, d).index_copy_(0, slots, rows)
    else:  # a strided view: FP8 V blocks stored key-major (attention/backend.py)
        cache[slots // bs, slots % bs] = rows


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The step's facts every layer shares: whether any slot is -1 (padding, nothing stored),
    and the decodes' gather layout: their blocks flattened ([nd * nblk]), the key mask
    ([nd, 1, 1, span]) and the span of tokens gathered per request; the mask of a sliding
    window is made from it the first time a layer with that window asks."""

    all_slots_valid: bool
    block_ids: torch.Tensor | None = None  # [nd * nblk] int64; None without decodes
    mask: torch.Tensor | None = None  # [nd, 1, 1, span] bool
    span: int = 0
    lens: torch.Tensor | None = None  # [nd] int64 context lengths of the decodes
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        assert self.mask is not None and self.lens is not None
        if sliding_window is None:
            return self.mask
        got = self.window_masks.get(sliding_window)
        if got is None:
            keys = torch.arange(self.span, device=self.mask.device)[None, :]
            inside = (keys >= self.lens[:, None] - sliding_window)[:, None, None, :]
            got = self.window_masks[sliding_window] = self.mask & inside
        return got


def torch_metadata(batch: ForwardBatch, bs: int) -> TorchAttentionMetadata:
    meta = TorchAttentionMetadata(bool((batch.slot_mapping >= 0).all()))
    nd = batch.num_decodes
    if nd:
        device = batch.block_tables.device
        nblk = (max(batch.seq_lens_cpu[:nd]) + bs - 1) // bs
        meta.block_ids = batch.block_tables[:nd, :nblk].reshape(-1).to(device=device, dtype=torch.long)
        meta.lens = batch.seq_lens[:nd].to(device=device, dtype=torch.long)
        meta.mask = (torch.arange(nblk * bs, device=device)[None, :] < meta.lens[:, None])[:, None, None, :]
        meta.span = nblk * bs
    return meta


def _metadata(batch: ForwardBatch, bs: int) -> TorchAttentionMetadata:
    """The batch's metadata; built here for a batch that did not come from the runner."""
    meta = batch.attn_metadata
    if not isinstance(meta, TorchAttentionMetadata):
        meta = batch.attn_metadata = torch_metadata(batch, bs)
    return meta


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            soft_cap: float | None, gqa: bool = False) -> torch.Tensor:
    """SDPA, or with `soft_cap` its steps written out (HF Gemma 2's eager order: scale, cap,
    mask, float32 softmax). q [..., Hq, M, D], k/v [..., Hkv, N, D], mask [M, N] (or
    broadcastable; None = causal from the top-left) -> [..., Hq, M, D]."""
    if soft_cap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / soft_cap) * soft_cap
    if mask is None:
        m, n = s.shape[-2:]
        mask = torch.ones(m, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    decode_attention=None,
    k_scale: float = 1.0,  # the cache's scales (FP8): real K/V = stored * scale
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of every scheduled query over its request's paged context (already stored).
    `decode_attention(q[:nd], k_cache, v_cache, batch, scale) -> [nd, Hq, D]`, if given, takes
    the decodes' place of the gather + SDPA below (a backend's own decode kernel, which must
    honour the same window and soft cap; only for unscaled caches). The k scale folds into the
    softmax scale, the v scale into the output."""
    if k_scale != 1.0 or v_scale != 1.0:
        out = paged_attention_torch(q, k_cache, v_cache, batch, scale * k_scale, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)
        return out * v_scale if v_scale != 1.0 else out
    _, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    nd = batch.num_decodes
    # decodes only, one row each: SDPA's output is the result, nothing to copy
    out = None if 0 < nd == batch.num_reqs == q.shape[0] else torch.empty_like(q)
    gqa = hq != hkv
    if nd > 0 and decode_attention is not None:
        o = decode_attention(q[:nd], k_cache, v_cache, batch, scale)
        if out is None:
            return o
        out[:nd] = o
    elif nd > 0:
        meta = _metadata(batch, bs)
        assert meta.block_ids is not None
        idx, mask, span = meta.block_ids, meta.decode_mask(sliding_window), meta.span
        # index_select of whole blocks, then [nd, Hkv, span, D] views; no copy by transpose
        kd = k_cache.index_select(0, idx).view(nd, span, hkv, d).transpose(1, 2)
        vd = v_cache.index_select(0, idx).view(nd, span, hkv, d).transpose(1, 2)
        # GQA without repeating K/V: the query heads of one group become that kv head's
        # query rows ([nd, Hkv, Hq/Hkv, D]), which every row of the group shares the mask of
        qd = q[:nd].reshape(nd, hkv, hq // hkv, d)
        o = _attend(qd, kd.to(q.dtype), vd.to(q.dtype), mask, scale, logits_soft_cap)
        if out is None:
            return o.reshape(nd, hq, d)
        out[:nd] = o.reshape(nd, hq, d)
    start = nd  # decodes hold one token each
    for i in range(nd, batch.num_reqs):
        qlen, slen = batch.query_lens_cpu[i], batch.seq_lens_cpu[i]
        nblk = (slen + bs - 1) // bs
        bt = batch.block_tables[i, :nblk].to(device=q.device, dtype=torch.long)
        kc = k_cache.index_select(0, bt).view(nblk * bs, hkv, d)[:slen].transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        vc = v_cache.index_select(0, bt).view(nblk * bs, hkv, d)[:slen].transpose(0, 1).to(q.dtype)
        qi = q[start : start + qlen].transpose(0, 1)  # [Hq, qlen, D]
        ctx = slen - qlen
        if ctx == 0 and sliding_window is None:
            o = _attend(qi, kc, vc, None, scale, logits_soft_cap, gqa)
        else:
            # query j sits at position ctx + j and sees keys 0 .. ctx + j (the last W of them)
            qpos = torch.arange(qlen, device=q.device)[:, None] + ctx
            keys = torch.arange(slen, device=q.device)[None, :]
            mask = keys <= qpos
            if sliding_window is not None:
                mask &= keys > qpos - sliding_window
            o = _attend(qi, kc, vc, mask, scale, logits_soft_cap, gqa)
        out[start : start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
        return torch_metadata(batch, block_size)

    def decode_kernel(self, q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None):
        """A subclass's own decode attention for these tensors and options (see
        paged_attention_torch's `decode_attention`); None: the gather + SDPA path."""
        return None

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        all_valid = _metadata(batch, k_cache.shape[1]).all_slots_valid
        store_kv_torch(k, v, k_cache, v_cache, batch.slot_mapping, all_valid, k_scale, v_scale)
        decode = self.decode_kernel(q, k_cache, sliding_window, logits_soft_cap)
        return paged_attention_torch(q, k_cache, v_cache, batch, scale, decode, k_scale, v_scale,
                                     sliding_window, logits_soft_cap)
