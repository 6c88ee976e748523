"""Triton kernels vs their torch references on CUDA: checks each on random inputs, then times
both with triton.testing.do_bench (median ms) and prints a table; with $OUT set, also writes
$OUT/kernels_bench.log (the full log, sweeps included) and $OUT/kernels_bench.json.

    python benchmarks/kernels_bench.py            # all groups
    python benchmarks/kernels_bench.py --quick    # fewer shapes, no sweeps

Shapes are Llama-3.1-8B's (hidden 4096, 32 q heads, 8 kv heads, head_dim 128, MLP 14336) in
bf16, with a paged cache of block size 16. Bandwidth figures count the bytes each kernel must
move at least (K/V read once for attention), against the H200's ~4.3 TB/s copy rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.attention.backend import ForwardBatch  # noqa: E402
from pagedllm.attention.torch_backend import paged_attention_torch, store_kv_torch  # noqa: E402
from pagedllm.kernels.activation import silu_and_mul_torch  # noqa: E402
from pagedllm.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch  # noqa: E402
from pagedllm.kernels.rotary import apply_rotary_torch  # noqa: E402

LOG: list[str] = []
ROWS: list[dict] = []


def log(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def record(group, shape, err, t_triton, t_torch, nbytes=None, flops=None):
    row = {"kernel": group, "shape": shape, "max_abs_err": err, "triton_ms": t_triton, "torch_ms": t_torch}
    row["speedup"] = t_torch / t_triton if t_triton > 0 else float("nan")
    extra = ""
    if nbytes:
        row["triton_GBps"] = nbytes / t_triton / 1e6
        extra += f"  {row['triton_GBps']:7.0f} GB/s"
    if flops:
        row["triton_TFLOPs"] = flops / t_triton / 1e9
        extra += f"  {row['triton_TFLOPs']:6.1f} TFLOP/s"
    ROWS.append(row)
    log(
        f"{group:<14} {shape:<34} err {err:9.2e}  triton {t_triton * 1e3:9.1f} us  "
        f"torch {t_torch * 1e3:9.1f} us  x{row['speedup']:6.2f}{extra}"
    )


def paged_batch(query_lens, seq_lens, num_decodes, block_size, device, gen):
    nblk = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    start = 0
    slots = []
    for r, (ql, sl, nb) in enumerate(zip(query_lens, seq_lens, nblk)):
        block_tables[r, :nb] = perm[start : start + nb]
        start += nb
        pos = torch.arange(sl - ql, sl)
        slots.append(block_tables[r, pos // block_size].long() * block_size + pos % block_size)
    qsl = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    t = int(qsl[-1])
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=torch.zeros(t, dtype=torch.int64, device=device),
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        logits_indices=(qsl[1:] - 1).long().to(device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return batch, num_blocks


# -------------------------------------------------------------------------------- groups


def bench_elementwise(quick: bool, dtype=torch.bfloat16) -> None:
    from pagedllm.kernels.activation_triton import silu_and_mul_triton
    from pagedllm.kernels.norm_triton import fused_add_rms_norm_triton, rms_norm_triton
    from pagedllm.kernels.rotary_triton import apply_rotary_triton

    dev = "cuda"
    tokens = [1, 8192] if not quick else [8192]
    for t in tokens:
        h = 4096
        x = torch.randn(t, h, device=dev, dtype=dtype)
        r = torch.randn(t, h, device=dev, dtype=dtype)
        w = torch.randn(h, device=dev, dtype=dtype)
        nbytes = 2 * t * h * x.element_size()
        err = max_err(rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
        record("rms_norm", f"T={t} H={h}", err, bench(lambda: rms_norm_triton(x, w, 1e-6)),
               bench(lambda: rms_norm_torch(x, w, 1e-6)), nbytes)  # fmt: skip
        a, b = fused_add_rms_norm_triton(x, r, w, 1e-6), fused_add_rms_norm_torch(x, r, w, 1e-6)
        err = max(max_err(a[0], b[0]), max_err(a[1], b[1]))
        record("add_rms_norm", f"T={t} H={h}", err, bench(lambda: fused_add_rms_norm_triton(x, r, w, 1e-6)),
               bench(lambda: fused_add_rms_norm_torch(x, r, w, 1e-6)), 2 * nbytes)  # fmt: skip

        d = 14336
        xg = torch.randn(t, 2 * d, device=dev, dtype=dtype)
        err = max_err(silu_and_mul_triton(xg), silu_and_mul_torch(xg))
        record("silu_and_mul", f"T={t} d={d}", err, bench(lambda: silu_and_mul_triton(xg)),
               bench(lambda: silu_and_mul_torch(xg)), 3 * t * d * xg.element_size())  # fmt: skip

        hq, hkv, hd, max_pos = 32, 8, 128, 8192
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32, device=dev) / hd))
        emb = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=dev), inv)
        emb = torch.cat((emb, emb), -1)
        cos, sin = emb.cos(), emb.sin()
        pos = torch.randint(0, max_pos, (t,), device=dev)
        qkv = torch.randn(t, (hq + 2 * hkv) * hd, device=dev, dtype=dtype)
        q = qkv[:, : hq * hd].view(t, hq, hd)
        k = qkv[:, hq * hd : (hq + hkv) * hd].view(t, hkv, hd)
        a, b = apply_rotary_triton(pos, q, k, cos, sin), apply_rotary_torch(pos, q, k, cos, sin)
        err = max(max_err(a[0], b[0]), max_err(a[1], b[1]))
        record("rotary", f"T={t} Hq={hq} Hkv={hkv} D={hd}", err,
               bench(lambda: apply_rotary_triton(pos, q, k, cos, sin)),
               bench(lambda: apply_rotary_torch(pos, q, k, cos, sin)),
               2 * t * (hq + hkv) * hd * qkv.element_size())  # fmt: skip


def bench_store_kv(quick: bool, dtype=torch.bfloat16) -> None:
    from pagedllm.kernels.attention import store_kv_triton

    dev, hkv, hd, bs = "cuda", 8, 128, 16
    for t in [1, 8192] if not quick else [8192]:
        nb = 2 * t // bs + 2
        slots = torch.randperm(nb * bs, device=dev)[:t]
        k = torch.randn(t, hkv, hd, device=dev, dtype=dtype)
        v = torch.randn(t, hkv, hd, device=dev, dtype=dtype)
        kc = torch.randn(nb, bs, hkv, hd, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        kr, vr = kc.clone(), vc.clone()
        store_kv_triton(k, v, kc, vc, slots)
        store_kv_torch(k, v, kr, vr, slots)
        err = max(max_err(kc, kr), max_err(vc, vr))
        record("store_kv", f"T={t} Hkv={hkv} D={hd} bs={bs}", err,
               bench(lambda: store_kv_triton(k, v, kc, vc, slots)),
               bench(lambda: store_kv_torch(k, v, kr, vr, slots)), 4 * t * hkv * hd * k.element_size())  # fmt: skip


def _attn_setup(query_lens, seq_lens, num_decodes, dtype, hq=32, hkv=8, hd=128, bs=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, nb = paged_batch(query_lens, seq_lens, num_decodes, bs, "cuda", gen)
    t = batch.num_tokens
    q = torch.randn(t, hq, hd, device="cuda", dtype=dtype)
    kc = torch.randn(nb, bs, hkv, hd, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    return batch, q, kc, vc


def bench_decode(quick: bool, sweep: bool, dtype=torch.bfloat16) -> None:
    from pagedllm.kernels._triton import num_sms
    from pagedllm.kernels.attention_decode import decode_attention_triton, decode_num_splits

    hq, hkv, hd = 32, 8, 128
    cases = [(1, 1024), (1, 32768), (8, 8192), (64, 2048), (256, 1024)]
    if quick:
        cases = [(1, 32768), (64, 2048)]
    for b, s in cases:
        seq_lens = [s] * b
        batch, q, kc, vc = _attn_setup([1] * b, seq_lens, b, dtype)
        out = torch.empty_like(q)
        scale = hd**-0.5
        splits = decode_num_splits(b, hkv, s, num_sms(0))

        def run(ns=None, bn=None):
            return decode_attention_triton(q, kc, vc, batch.block_tables, batch.seq_lens, out, scale,
                                           max_seq_len=s, num_splits=ns, block_n=bn)  # fmt: skip

        ref = paged_attention_torch(q, kc, vc, batch, scale)
        err = max_err(run(), ref)
        kv_bytes = 2 * b * s * hkv * hd * q.element_size()
        record("decode", f"B={b} L={s} splits={splits}", err, bench(run),
               bench(lambda: paged_attention_torch(q, kc, vc, batch, scale)), kv_bytes)  # fmt: skip
        if sweep and b in (1, 8, 64):
            for ns in sorted({1, splits, min(64, splits * 2)}):
                for bn in (32, 64):
                    e = max_err(run(ns, bn), ref)
                    ms = bench(lambda: run(ns, bn))
                    log(f"    sweep decode B={b} L={s} splits={ns:<3} block_n={bn:<4} {ms * 1e3:8.1f} us "
                        f"{kv_bytes / ms / 1e6:7.0f} GB/s err {e:.1e}")  # fmt: skip


def bench_prefill(quick: bool, sweep: bool, dtype=torch.bfloat16) -> None:
    import torch.nn.functional as F

    from pagedllm.kernels.attention import _prefill_config, prefill_attention_triton

    hq, hkv, hd = 32, 8, 128
    # (query_lens, seq_lens): fresh prompts; one chunk over a long cached prefix
    cases = [([1024] * 4, [1024] * 4), ([4096], [4096]), ([512], [8192]), ([256] * 8, [2304] * 8)]
    if quick:
        cases = cases[:3]
    for qls, sls in cases:
        batch, q, kc, vc = _attn_setup(qls, sls, 0, dtype)
        out = torch.empty_like(q)
        scale = hd**-0.5

        def run(cfg=None):
            return prefill_attention_triton(q, kc, vc, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                            out, scale, first_req=0, num_reqs=batch.num_reqs,
                                            max_query_len=batch.max_query_len, config=cfg)  # fmt: skip

        ref = paged_attention_torch(q, kc, vc, batch, scale)
        err = max_err(run(), ref)
        flops = sum(4 * hq * hd * ql * (sl - ql + (ql + 1) / 2) for ql, sl in zip(qls, sls))
        name = f"{len(qls)}x q={qls[0]} ctx={sls[0] - qls[0]}"
        record("prefill", name, err, bench(run), bench(lambda: paged_attention_torch(q, kc, vc, batch, scale)),
               flops=flops)  # fmt: skip
        if sweep:
            # dense flash attention on contiguous K/V, the ceiling a paged kernel aims at
            if all(ql == sl for ql, sl in zip(qls, sls)):
                n = len(qls)
                qd = q.view(n, qls[0], hq, hd).transpose(1, 2)
                kd = torch.randn(n, hkv, qls[0], hd, device="cuda", dtype=dtype)
                vd = torch.randn_like(kd)
                ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
                log(f"    peer  torch SDPA dense causal (no paging)          {ms * 1e3:8.1f} us "
                    f"{flops / ms / 1e9:6.1f} TFLOP/s")  # fmt: skip
            for cfg in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2)]:
                try:
                    e = max_err(run(cfg), ref)
                    ms = bench(lambda: run(cfg))
                    log(f"    sweep prefill {name} cfg(BM,BN,warps,stages)={cfg} {ms * 1e3:8.1f} us "
                        f"{flops / ms / 1e9:6.1f} TFLOP/s err {e:.1e}")  # fmt: skip
                except Exception as exc:  # e.g. out of shared memory
                    log(f"    sweep prefill {name} cfg={cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
            log(f"    default config: {_prefill_config(hd, dtype)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no sweeps")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench: needs CUDA; nothing to do")
        return
    torch.manual_seed(0)
    t0 = time.time()
    log(f"# kernels_bench {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch {torch.__version__}")
    import triton

    log(f"# triton {triton.__version__}; times are medians of triton.testing.do_bench; bf16 unless noted")
    sweep = not args.quick
    for fn in (
        lambda: bench_elementwise(args.quick),
        lambda: bench_store_kv(args.quick),
        lambda: bench_decode(args.quick, sweep),
        lambda: bench_prefill(args.quick, sweep),
    ):
        try:
            fn()
        except Exception as exc:  # keep going: one broken group must not hide the others' figures
            import traceback

            log(f"!! group failed: {type(exc).__name__}: {exc}")
            log(traceback.format_exc())
    log("")
    log(f"{'kernel':<14} {'shape':<34} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'max err':>9}")
    for r in ROWS:
        log(f"{r['kernel']:<14} {r['shape']:<34} {r['triton_ms'] * 1e3:10.1f} {r['torch_ms'] * 1e3:10.1f} "
            f"{r['speedup']:8.2f} {r['max_abs_err']:9.1e}")  # fmt: skip
    log(f"# total {time.time() - t0:.0f} s")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "kernels_bench.log").write_text("\n".join(LOG) + "\n")
        Path(out, "kernels_bench.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
