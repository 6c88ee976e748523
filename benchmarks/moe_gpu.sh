#!/usr/bin/env bash
# MoE batch 1 on the H200 in one call (< 4 minutes): the MoE kernel tests, then batch-1 decode of
# Qwen3-30B-A3B (dummy bf16, benchmarks/moe_bench.py's W2 method) with the grouped path, alone and
# with PAGEDLLM_FUSED_ROPE_KV=1 (q/k norm + rotary + store-KV in one kernel); a table last.
# Logs and JSON to $OUT. (The small-batch MoE path and the few-rows GEMV this script once A/B'd
# lost on the H200 and were removed: benchmarks/RESULTS.md, seventh session.)
#   bash benchmarks/moe_gpu.sh            # from the repo root
# CPU smoke of the script itself: PYTHON=.venv/bin/python BENCH_EXTRA="--tiny --output-len 8" bash benchmarks/moe_gpu.sh
set -uo pipefail
OUT=${OUT:-./moe-gpu-out}
BUDGET=${BUDGET:-230}   # seconds; a step that could overrun it is skipped
. benchmarks/gpu_common.sh

fits 80 tests && { timeout 80 $PY -m pytest -q tests/gpu/test_fused_moe.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|Error" "$OUT/tests.log" | head -5; }

latency() {  # name fused_rope_kv
  fits 48 "latency $1" || return
  PAGEDLLM_FUSED_ROPE_KV=$2 timeout 48 $PY benchmarks/moe_bench.py \
    --skip-w1 --skip-peer --skip-kernels --latency-iters 2 ${BENCH_EXTRA:-} --output-json "$OUT/lat_$1.json" > "$OUT/lat_$1.log" 2>&1
  echo "latency $1 rc=$? at ${SECONDS} s: $(grep -E 'batch 1:' "$OUT/lat_$1.log")"; grep -E "Error" "$OUT/lat_$1.log" | head -3
}
latency grouped 0
latency rope_kv 1

$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
print("\n=== MoE batch 1: Qwen3-30B-A3B dummy bf16, batch-1 decode ===")
base = load("lat_grouped.json")
print(f"{'variant':<10} {'ms/token':>9} {'iters':>18} {'greedy ids equal to grouped: matching prefix, per iter':>56}")
for name in ("grouped", "rope_kv"):
    r = load(f"lat_{name}.json")
    if not r:
        print(f"{name:<10} {'(no result)':>9}"); continue
    lat = r["ours_latency"]
    same = "-"
    if base and name != "grouped":
        pre = []
        for a, b in zip(base["ours_latency"]["token_ids"], lat["token_ids"]):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            pre.append(str(n))
        same = " / ".join(pre)
    print(f"{name:<10} {lat['decode_ms_per_token']:>9.3f} {str(lat['decode_ms_all_iters']):>18} {same:>56}")
PYEOF
