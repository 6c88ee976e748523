#!/usr/bin/env bash
# Issue 15's "last program reduces" switches on the H200 in one call (about 4-5 minutes; the
# measurements first, about 3): each A/B alone, then Qwen3-30B-A3B batch-1 decode (dummy bf16,
# moe_bench.py's W2 method) with all three switches off and on, then the GPU tests of the new
# code. Logs and JSON to $OUT; a summary last.
#   PAGEDLLM_SWAP_LAST_REDUCE     split-K GEMMs of 1-16 rows reduced by their last split (default on)
#   PAGEDLLM_FUSED_ROUTER         MoE router + softmax/top-k in one launch, 1-16 tokens (default on)
#   PAGEDLLM_DECODE_LAST_REDUCE   decode attention's splits merged by the last split (default: 16-bit
#                                 caches split at most 9 ways); each forced to 0 / 1 here
# (RESULTS.md, twelfth session: what this script measured and the defaults it led to)
#     bash benchmarks/last_reduce_gpu.sh            # from the repo root
set -uo pipefail
OUT=${OUT:-./last-reduce-out}
BUDGET=${BUDGET:-560}   # seconds; a step that could overrun it is skipped
. benchmarks/gpu_common.sh
step() {  # name seconds command...: runs it with a timeout, logs to $OUT/name.log
  local name=$1 limit=$2; shift 2
  fits "$limit" "$name" || return
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at ${SECONDS} s"; grep -E "Error|WRONG|differ" "$OUT/$name.log" | head -3
}

step gemm 100 $PY benchmarks/small_m_bench.py --last-reduce --output-json "$OUT/gemm.json"
step decode 90 $PY benchmarks/decode_sweep.py --last-reduce-ab --out "$OUT/decode.json"
step router 60 $PY benchmarks/moe_bench.py --skip-kernels --skip-latency --router-ab --output-json "$OUT/router.json"
latency() {  # name on(0/1)
  fits 60 "latency $1" || return
  PAGEDLLM_SWAP_LAST_REDUCE=$2 PAGEDLLM_FUSED_ROUTER=$2 PAGEDLLM_DECODE_LAST_REDUCE=$2 timeout 60 \
    $PY benchmarks/moe_bench.py --skip-w1 --skip-peer --skip-kernels --latency-iters 2 \
    --output-json "$OUT/lat_$1.json" > "$OUT/lat_$1.log" 2>&1
  echo "latency $1 rc=$? at ${SECONDS} s: $(grep -E 'batch 1:' "$OUT/lat_$1.log")"; grep -E "Error" "$OUT/lat_$1.log" | head -3
}
latency off 0
latency on 1
step tests 150 $PY -m pytest -q tests/gpu/test_small_m_gpu.py tests/gpu/test_kernels.py \
  -k "last_reduce or router_topk or last_program or fused_router"
tail -1 "$OUT/tests.log" 2>/dev/null; grep -E "^FAILED" "$OUT/tests.log" 2>/dev/null | head -8

echo; echo "=== split-K GEMM, us per layer (cuBLAS / reduce kernel / last split) ==="
cat "$OUT/gemm.log" 2>/dev/null | grep -E "^(shape|qwen|llama)"
echo; echo "=== decode attention, us per layer (reduce kernel / last split) ==="
grep -E "^(model|qwen3moe|llama8b)" "$OUT/decode.log" 2>/dev/null
echo; echo "=== router + top-k, us per layer ==="
grep -E "T=" "$OUT/router.log" 2>/dev/null
$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
print("\n=== Qwen3-30B-A3B batch-1 decode, ms/token: the three switches off / on ===")
base = load("lat_off.json")
for name in ("off", "on"):
    r = load(f"lat_{name}.json")
    if not r:
        print(f"{name:<4} (no result)"); continue
    lat = r["ours_latency"]
    same = "-"
    if base and name != "off":
        pre = [str(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
               for a, b in zip(base["ours_latency"]["token_ids"], lat["token_ids"])]
        same = "greedy ids equal to off for the first " + " / ".join(pre) + " tokens"
    print(f"{name:<4} {lat['decode_ms_per_token']:7.3f} {lat['decode_ms_all_iters']}  {same}")
PYEOF
