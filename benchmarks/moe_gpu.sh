#!/usr/bin/env bash
# The MoE small-batch path on the H200 in one call (< 4 minutes): the MoE kernel tests, batch-1
# decode of Qwen3-30B-A3B (dummy bf16, benchmarks/moe_bench.py's W2 method) with the grouped path
# (main's default), the small-batch path with tensor cores (alone, then with the few-rows kernel
# for q/k/v, o and the router, then also with PAGEDLLM_FUSED_ROPE_KV=1), and while time is left
# per-layer timings in CUDA graphs (routing + experts at 1, 2, 4 tokens; the projections at 1 row;
# a few tiles) and the small path with CUDA-core FMAs; a table last.
# Logs and JSON to $OUT. The switch: PAGEDLLM_MOE_SMALL_PAIRS (pairs T*K served by the small path,
# 0 = off) and PAGEDLLM_MOE_SMALL_DOT (1 tensor cores, 0 FMAs), pagedllm/kernels/fused_moe.py;
# PAGEDLLM_FEW_ROWS_GEMV (rows, 0 = off), pagedllm/kernels/few_rows.py.
#   bash benchmarks/moe_gpu.sh            # from the repo root (/work/notes/gpu_moe.sh is a copy)
# CPU smoke of the script itself: PYTHON=.venv/bin/python BENCH_EXTRA="--tiny --output-len 8" bash benchmarks/moe_gpu.sh
set -uo pipefail
[ -f benchmarks/moe_bench.py ] || { echo "run from the repo root"; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-./moe-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-230}   # seconds; a step that could overrun it is skipped
fits() { [ $((SECONDS + $1)) -le "$BUDGET" ] || { echo "skipped $2 (${SECONDS} s used)"; return 1; }; }

fits 80 tests && { timeout 80 $PY -m pytest -q tests/gpu/test_fused_moe.py tests/gpu/test_few_rows.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|Error" "$OUT/tests.log" | head -5; }

latency() {  # name small_pairs small_dot few_rows fused_rope_kv
  fits 48 "latency $1" || return
  PAGEDLLM_MOE_SMALL_PAIRS=$2 PAGEDLLM_MOE_SMALL_DOT=$3 PAGEDLLM_FEW_ROWS_GEMV=$4 PAGEDLLM_FUSED_ROPE_KV=$5 \
    timeout 48 $PY benchmarks/moe_bench.py \
    --skip-w1 --skip-peer --skip-kernels --latency-iters 2 ${BENCH_EXTRA:-} --output-json "$OUT/lat_$1.json" > "$OUT/lat_$1.log" 2>&1
  echo "latency $1 rc=$? at ${SECONDS} s: $(grep -E 'batch 1:' "$OUT/lat_$1.log")"; grep -E "Error" "$OUT/lat_$1.log" | head -3
}
latency grouped 0 1 0 0
latency small_dot 16 1 0 0
latency small_dot_few_rows 16 1 1 0
latency all_on 16 1 1 1   # + helper fuse's q/k norm + rotary + store-KV kernel (on main, off by default)
fits 60 kernels && { timeout 60 $PY benchmarks/moe_bench.py --skip-kernels --small-path-kernels --skip-latency \
    --output-json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$? at ${SECONDS} s"; grep -E "failed|Error" "$OUT/kernels.log" | cut -c1-150 | head -8; }
latency small_fma 16 0 0 0

$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
print("\n=== MoE small-batch path: Qwen3-30B-A3B dummy bf16, batch-1 decode (target <= 2.5 ms/token) ===")
base = load("lat_grouped.json")
print(f"{'variant':<19} {'ms/token':>9} {'iters':>18} {'greedy ids equal to grouped: matching prefix, per iter':>56}")
for name in ("grouped", "small_dot", "small_dot_few_rows", "all_on", "small_fma"):
    r = load(f"lat_{name}.json")
    if not r:
        print(f"{name:<19} {'(no result)':>9}"); continue
    lat = r["ours_latency"]
    same = "-"
    if base and name != "grouped":
        pre = []
        for a, b in zip(base["ours_latency"]["token_ids"], lat["token_ids"]):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            pre.append(str(n))
        same = " / ".join(pre)
    print(f"{name:<19} {lat['decode_ms_per_token']:>9.3f} {str(lat['decode_ms_all_iters']):>18} {same:>56}")
k = load("kernels.json")
if k and k.get("small_path_kernels"):
    print("\nrouting + experts per layer, us in a CUDA graph (GB/s of the distinct experts' weights)")
    rows = k["small_path_kernels"]
    for t in sorted({r["tokens"] for r in rows}):
        line = [f"T={t}:"]
        for path in ("grouped", "small dot", "small fma"):
            rs = [r for r in rows if r["tokens"] == t and r["path"] == path]
            if not rs:
                continue
            d = next((r for r in rs if r["config"] == "default"), None)
            b = min(rs, key=lambda r: r["us"])
            txt = f"{path} {d['us'] if d else '-'} ({d['weight_GB_per_s'] if d else '-'})"
            if b is not d:
                txt += f", best {b['us']} {b['config']}"
            line.append(txt + f" |diff| {max(r['max_abs_diff_vs_grouped'] for r in rs):.1e}")
        print("  ".join(line[:1]) + " " + "\n      ".join(line[1:]))
if k and k.get("dense_kernels"):
    print("\nprojections at 1 row, us per layer in a CUDA graph (GB/s)")
    rows = k["dense_kernels"]
    for proj in ("qkv", "o", "router"):
        rs = [r for r in rows if r["proj"] == proj]
        cb = next((r for r in rs if r["path"] == "cublas"), None)
        fr = [r for r in rs if r["path"] == "few_rows"]
        d = next((r for r in fr if r["config"] == "default"), None)
        b = min(fr, key=lambda r: r["us"]) if fr else None
        fmt = lambda r: f"{r['us']} ({r['GB_per_s']})" if r else "-"
        print(f"  {proj:<6} cuBLAS {fmt(cb)}  few_rows default {fmt(d)}  best {fmt(b)} {b['config'] if b else ''}"
              f"  |diff| {max((r['max_abs_diff_vs_cublas'] for r in fr), default=float('nan')):.1e}")
PYEOF
