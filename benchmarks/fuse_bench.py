"""The fused decode-step kernel against the chain it replaces, on CUDA, timed as decode steps
run them: in a CUDA graph of 32 layers, each with its own weights and KV cache (fp8_bench.py's
`graph_time`, us per layer). Checks the fused result against the unfused one first.

- rope_kv: the attention block's work between the qkv projection and attention. Unfused: split,
  [q_norm + k_norm (Qwen3)], rotary, store-KV, as the layers run them; fused: one kernel
  (kernels/qkv_rope_triton.py). Llama-3.1-8B (32/8 heads) at 1 and 16 rows, Qwen3-0.6B (16/8
  heads, q/k norm) at 1 and 256 rows; bf16 and FP8 e4m3 caches.

    PYTHONPATH=. python benchmarks/fuse_bench.py        # with $OUT set: $OUT/fuse_bench.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_bench import LAYERS, graph_time  # noqa: E402

from pagedllm.kernels.attention import store_kv_triton  # noqa: E402
from pagedllm.kernels.norm_triton import rms_norm_triton  # noqa: E402
from pagedllm.kernels.qkv_rope_triton import qkv_norm_rope_store_triton  # noqa: E402
from pagedllm.kernels.rotary_triton import apply_rotary_triton  # noqa: E402

# name -> (q heads, kv heads, head_dim, q/k norm, rows)
ROPE_MODELS = {"llama-8b": (32, 8, 128, False, (1, 16)), "qwen3-0.6b": (16, 8, 128, True, (1, 256))}
BLOCK_SIZE = 16


def _rope_layers(hq, hkv, d, rows, cache_dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    pos = torch.randint(0, 4000, (rows,), device="cuda", generator=g)
    freqs = torch.outer(torch.arange(4096, device="cuda", dtype=torch.float32),
                        1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    num_blocks = rows // BLOCK_SIZE + 8
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda", generator=g)[:rows]
    layers = []
    for _ in range(LAYERS):
        qkv = torch.randn(rows, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d, device="cuda", dtype=cache_dtype)
        layers.append((qkv, kc, torch.zeros_like(kc), torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5))
    return pos, cos, sin, slots, layers


def _unfused(pos, cos, sin, slots, qkv, kc, vc, w, hq, hkv, d, norm, ks, vs):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if norm:
        q, k = rms_norm_triton(q, w, 1e-6), rms_norm_triton(k, w, 1e-6)
    q, k = apply_rotary_triton(pos, q, k, cos, sin)
    store_kv_triton(k, v, kc, vc, slots, ks, vs)
    return q


def _fused(pos, cos, sin, slots, qkv, kc, vc, w, hq, hkv, d, norm, ks, vs):
    return qkv_norm_rope_store_triton(qkv, pos, cos, sin, kc, vc, slots, hq, hkv, d, w if norm else None,
                                      w if norm else None, 1e-6, ks, vs)  # fmt: skip


def _over_layers(fn, head, layers, tail):
    """A call of fn for every layer: fn(*head, *layer, *tail)."""
    return lambda: [fn(*head, *layer, *tail) for layer in layers]


def bench_rope_kv() -> dict:
    out = {}
    for name, (hq, hkv, d, norm, rows_list) in ROPE_MODELS.items():
        for rows in rows_list:
            for cache in ("bf16", "fp8"):
                cdt = torch.bfloat16 if cache == "bf16" else torch.float8_e4m3fn
                ks, vs = (1.0, 1.0) if cache == "bf16" else (0.05, 0.05)
                pos, cos, sin, slots, layers = _rope_layers(hq, hkv, d, rows, cdt)
                qkv, kc, vc, w = layers[0]
                kc2, vc2 = kc.clone(), vc.clone()
                a = _unfused(pos, cos, sin, slots, qkv, kc, vc, w, hq, hkv, d, norm, ks, vs)
                b = _fused(pos, cos, sin, slots, qkv, kc2, vc2, w, hq, hkv, d, norm, ks, vs)
                # sanity only (tests/gpu/test_fused_gpu.py checks them): a one-ulp norm difference
                # moves an FP8 value near zero by a few steps
                torch.testing.assert_close(b, a, atol=5e-2, rtol=2e-2)
                torch.testing.assert_close(kc2.float() * ks, kc.float() * ks, atol=5e-2, rtol=0.13)
                head, tail = (pos, cos, sin, slots), (hq, hkv, d, norm, ks, vs)
                times = {label: graph_time(_over_layers(fn, head, layers, tail))
                         for label, fn in (("unfused", _unfused), ("fused", _fused))}  # fmt: skip
                out[f"{name}:{rows}:{cache}"] = times
                print(f"rope_kv {name:11s} rows {rows:4d} cache {cache:4s}: unfused {times['unfused']:6.2f} us, "
                      f"fused {times['fused']:6.2f} us per layer", flush=True)
    return out


def main() -> None:
    results = {"rope_kv": bench_rope_kv()}
    print("\n=== fused kernel, us per layer (CUDA graph of 32 layers) ===")
    print(f"{'case':34s} {'unfused':>8s} {'fused':>8s} {'saved x32 layers (ms)':>22s}")
    for kind, rows in results.items():
        for key, t in rows.items():
            print(f"{kind + ' ' + key:34s} {t['unfused']:8.2f} {t['fused']:8.2f} "
                  f"{(t['unfused'] - t['fused']) * LAYERS / 1000:22.3f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fuse_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
