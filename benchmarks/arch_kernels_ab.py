"""Plain-case speed of the paged-attention Triton kernels before and after the sliding-window /
soft-cap options (issue 17): main's kernel files (--main-root) and this tree's, loaded side by
side in one process and timed alternately (CUDA events, medians), at W2/W1-like shapes; then
this tree's kernels with a sliding window and a soft cap at the same shapes. GPU only.

    python benchmarks/arch_kernels_ab.py --main-root /path/to/main/checkout
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))


def load_main_kernels(main_root: str):
    """main's attention.py / attention_decode.py as modules of their own (the decode file's
    import of the shared tile helpers rewritten to main's copy)."""
    tmp = tempfile.mkdtemp()
    src = os.path.join(main_root, "pagedllm", "kernels")
    for name in ("attention", "attention_decode"):
        text = open(os.path.join(src, f"{name}.py")).read().replace(
            "from pagedllm.kernels.attention import", "from main_attention import")
        with open(os.path.join(tmp, f"main_{name}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, tmp)
    mods = []
    for name in ("main_attention", "main_attention_decode"):
        spec = importlib.util.spec_from_file_location(name, os.path.join(tmp, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def timed(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)  # us
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--main-root", required=True)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from test_kernels import _attention_inputs, make_batch

    from pagedllm.kernels import attention as ours_pf
    from pagedllm.kernels import attention_decode as ours_dec

    main_pf, main_dec = load_main_kernels(args.main_root)
    dt, bs = torch.bfloat16, 16
    cases = []
    for name, b, ctx, hq, hkv, d in [("decode b1 ctx1024 32/8x128", 1, 1024, 32, 8, 128),
                                     ("decode b64 ctx1024 32/8x128", 64, 1024, 32, 8, 128),
                                     ("decode b64 ctx1024 16/8x256", 64, 1024, 16, 8, 256)]:
        batch, nb = make_batch([1] * b, [ctx] * b, b, bs, "cuda")
        q, _, _, kc, vc = _attention_inputs(batch, nb, bs, hq, hkv, d, dt, "cuda", 0)
        out = torch.empty_like(q)

        def dec(mod, batch=batch, q=q, kc=kc, vc=vc, out=out, d=d, **kw):
            return lambda: mod.decode_attention_triton(q, kc, vc, batch.block_tables, batch.seq_lens, out, d**-0.5,
                                                       max_seq_len=batch.max_seq_len, **kw)
        cases.append((name, dec(main_dec), dec(ours_dec), dec(ours_dec, sliding_window=512, logits_soft_cap=50.0)))
    for name, lens, hq, hkv, d in [("prefill 1x1024 32/8x128", [1024], 32, 8, 128),
                                   ("prefill 4x512 16/8x256", [512] * 4, 16, 8, 256)]:
        batch, nb = make_batch(lens, lens, 0, bs, "cuda")
        q, _, _, kc, vc = _attention_inputs(batch, nb, bs, hq, hkv, d, dt, "cuda", 0)
        out = torch.empty_like(q)

        def pf(mod, batch=batch, q=q, kc=kc, vc=vc, out=out, d=d, **kw):
            return lambda: mod.prefill_attention_triton(q, kc, vc, batch.block_tables, batch.query_start_loc,
                                                        batch.seq_lens, out, d**-0.5, first_req=0,
                                                        num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
                                                        **kw)
        cases.append((name, pf(main_pf), pf(ours_pf), pf(ours_pf, sliding_window=256, logits_soft_cap=50.0)))
    print(f"{'case':32s} {'main us':>9s} {'ours us':>9s} {'ratio':>6s} {'win+cap us':>10s}   (medians; rounds alternate)")
    for name, f_main, f_ours, f_opt in cases:
        m, o = [], []
        for r in range(args.rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                (m if which == 0 else o).append(timed(f_main if which == 0 else f_ours))
        w = timed(f_opt)
        print(f"{name:32s} {statistics.median(m):9.1f} {statistics.median(o):9.1f} "
              f"{statistics.median(o) / statistics.median(m):6.3f} {w:10.1f}")


if __name__ == "__main__":
    main()
