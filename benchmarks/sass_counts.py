"""What one thread of a kernel issues per main-loop iteration on the H200, without one: the
kernels compiled for sm_90 on this machine (Triton's own ptxas) and their SASS read back
(nvdisasm), the longest loop's instructions counted by opcode (kernels/inspect_sm90.py). For
kernels bound by what the SM issues rather than by memory -- the FP8 decode kernel, the 4-bit
GEMV -- it compares variants before a device measures them (the device's Triton is 3.6: run it
with that version for the device's code; the figures are not timings).

    python benchmarks/sass_counts.py [--what decode gemv]

With the device's Triton (3.6) beside this tree's (the figures in RESULTS.md were taken so):

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/t36/lib/python3.11/site-packages/zz_venv.pth
    PYTHONPATH=. /tmp/t36/bin/python benchmarks/sass_counts.py

decode: the paged decode kernel at its default tiles, bf16 and FP8 caches, V blocks head_dim-major
("hd") and key-major ("vt", FP8's layout), Qwen3-0.6B's group 2 and Llama-3.1-8B's 4: instructions
a warp issues per tile, per key, registers. gemv: the 4-bit GEMV (float32 arithmetic) and gemvp
(packed 16-bit, inline PTX; plain, with the register prefetch "p1", with Triton's cp.async pipeline
of 3 / 4 stages "s3" / "s4"; "k" on the steps-permuted layout), bf16 and fp16 activations, groups
of 128, 32 x 1024 tiles and 8 warps (the W2 default), and the N-major gemvn at its default tiles:
instructions a thread issues per 32-bit word of weights."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_rows():
    from pagedllm.kernels import attention_decode as ad
    from pagedllm.kernels.inspect_sm90 import DECODE_STRIDES, compile_sm90, decode_signature, main_loop, resources, sass

    for cache, itemsize in (("bf16", 2), ("fp8e4nv", 1)):
        block_n, warps, stages = ad.DECODE_CONFIGS[itemsize]
        for group in (2, 4):
            for v_t in (False, True):
                const = dict(GROUP=group, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=128,
                             SPLIT=True, DOT_PRECISION="tf32", Q_AS_FP16=cache != "bf16", SLIDING=False,
                             SOFT_CAP=False, ORDERED=False, LAST_REDUCE=False, V_T=v_t)
                c = compile_sm90(ad._decode_kernel, decode_signature(cache), const, warps, stages,
                                 aligned=DECODE_STRIDES)
                ops = main_loop(sass(c) or "")
                n = sum(ops.values())
                top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
                print(f"decode {cache:7s} group {group} V {'vt' if v_t else 'hd'} {block_n}/{warps}/{stages}: "
                      f"{n:5d} a warp a tile, {n * warps / block_n:5.1f} a key, {resources(c)['regs']:3d} registers"
                      f"  [{top}]", flush=True)


def gemv_rows():
    from pagedllm.kernels import wna16_triton as w
    from pagedllm.kernels.inspect_sm90 import compile_sm90, main_loop, resources, sass

    block_n, block_kw, warps = 32, 128, 8
    # gemvp's loop modes (wna16_triton.gemv_prefetch): the next tile's words in registers (p1), Triton's
    # cp.async pipeline of 3 / 4 stages (s3 / s4); "k": the steps-permuted layout (KPERM, wna16.kperm_pack)
    modes = {"gemv": {}, "gemvp": {}, "gemvp p1": {"PREFETCH": True}, "gemvp s3": {"LOOP_STAGES": 3},
             "gemvp s4": {"LOOP_STAGES": 4}, "gemvp p1k": {"PREFETCH": True, "KPERM": True},
             "gemvp s4k": {"LOOP_STAGES": 4, "KPERM": True}}
    for name, mode in modes.items():
        kind = name.split()[0]
        for dt in ("bf16", "fp16"):
            sig = {"x_ptr": f"*{dt}", "w_ptr": "*i32", "s_ptr": f"*{dt}", "z_ptr": f"*{dt}", "b_ptr": f"*{dt}",
                   "out_ptr": f"*{dt}", "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32",
                   "KW": "i32", "KW_PER_SPLIT": "i32", "stride_xm": "i32", "stride_wk": "i32", "stride_sg": "i32",
                   "stride_om": "i32"}
            const = dict(GROUP_K=128, HAS_ZERO=False, HAS_BIAS=False, SPLIT_K=1, EVEN=True, BLOCK_N=block_n,
                         BLOCK_KW=block_kw, **({"BITS": 4} if kind == "gemv" else {}), **mode)
            kernel = w._wna16_gemv_kernel if kind == "gemv" else w._wna16_gemv_packed_kernel
            c = compile_sm90(kernel, sig, const, warps, 2, aligned=("N", "KW", "KW_PER_SPLIT", "stride_xm",
                                                                     "stride_wk", "stride_sg", "stride_om"))
            ops = main_loop(sass(c) or "")
            n = sum(ops.values())
            words = block_n * block_kw / (32 * warps)
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
            r = resources(c)
            print(f"{name:8s} {dt}: {n / words:5.1f} a word, {r['regs']:3d} registers, {r['shared']:6d} B shared  "
                  f"[{top}]", flush=True)
    gemvn_rows()


def gemvn_rows():
    """The N-major one-row GEMV (wna16_gemvn_triton.py) at its default tiles, groups of 128."""
    from pagedllm.kernels import wna16_gemvn_triton as g
    from pagedllm.kernels.inspect_sm90 import compile_sm90, main_loop, resources, sass

    block_n, block_kw, _, warps = g.gemvn_config(4096, 4096, 128)
    for dt in ("bf16", "fp16"):
        sig = {"x_ptr": f"*{dt}", "w_ptr": "*i32", "s_ptr": f"*{dt}", "z_ptr": f"*{dt}", "b_ptr": f"*{dt}",
               "out_ptr": f"*{dt}", "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "KW": "i32",
               "KW_PER_SPLIT": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"}
        const = dict(GROUP_K=128, HAS_ZERO=False, HAS_BIAS=False, SPLIT_K=1, EVEN=True, BLOCK_N=block_n,
                     BLOCK_KW=block_kw, ASM=True)
        c = compile_sm90(g._wna16_gemvn_kernel, sig, const, warps, 2, aligned=("N", "KW", "KW_PER_SPLIT", "stride_xm",
                                                                               "stride_wn", "stride_sn", "stride_om"))
        ops = main_loop(sass(c) or "")
        words = block_n * block_kw / (32 * warps)
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        print(f"gemvn {dt}: {sum(ops.values()) / words:5.1f} a word, {resources(c)['regs']:3d} registers  [{top}]",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", nargs="*", default=["decode", "gemv"], choices=["decode", "gemv"])
    args = ap.parse_args()
    import triton

    print(f"# sm_90 SASS, Triton {triton.__version__}: a main loop's instructions (not timings)")
    if "decode" in args.what:
        decode_rows()
    if "gemv" in args.what:
        gemv_rows()


if __name__ == "__main__":
    main()
