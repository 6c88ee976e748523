#!/usr/bin/env bash
# The FP8 KV cache's key-major V blocks (attention/backend.py, issue 14) on the H200 in one call
# (about 9 minutes): the FP8 attention GPU tests, then the decode kernel with V blocks key-major
# and head_dim-major for bf16 and FP8 caches (benchmarks/decode_sweep.py --v-layout-ab), then W1
# with a bf16 KV cache (A) and an FP8 one (B) alternated (benchmarks/ab_w1.sh; target B/A >= 1.3).
# Logs in one archive in $OUT; the tables last.
#     OUT=$OUT bash benchmarks/fp8kv_gpu.sh           # from the repo root
#     STEPS="sweep w1" ROUNDS=3 bash benchmarks/fp8kv_gpu.sh   # STEPS: any of tests sweep w1 w1fp8layout w1bf16layout
# w1fp8layout: W1 with an FP8 cache, V head_dim-major (A, PAGEDLLM_V_TRANSPOSED=0) and key-major (B);
# w1bf16layout: W1 with a bf16 cache, V head_dim-major (A) and key-major (B, PAGEDLLM_V_TRANSPOSED=1).
set -uo pipefail
OUT=${OUT:-./fp8kv-gpu-out}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-tests sweep w1}
BUDGET=${BUDGET:-570}   # seconds; a run that could overrun it is skipped
. benchmarks/gpu_common.sh

if [[ " $STEPS " == *" tests "* ]] && fits 210 tests; then
  timeout 100 $PY -m pytest -q tests/gpu/test_fp8_gpu.py -k "backend or decode or reference" > "$OUT/tests.log" 2>&1
  echo "fp8 attention tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/tests.log")"
  timeout 50 $PY -m pytest -q tests/gpu/test_fused_gpu.py -k "fp8 or e5m2 or key_major" > "$OUT/tests_fused.log" 2>&1
  echo "fused rope-store FP8 tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/tests_fused.log")"
  timeout 60 $PY -m pytest -q tests/gpu/test_kernels.py -k "key_major" > "$OUT/tests_key_major.log" 2>&1
  echo "16-bit key-major V tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/tests_key_major.log")"
  grep -hE "^(FAILED|ERROR)" "$OUT"/tests*.log | head -6
fi
if [[ " $STEPS " == *" sweep "* ]] && fits 150 sweep; then
  timeout 150 $PY benchmarks/decode_sweep.py --v-layout-ab > "$OUT/sweep.log" 2>&1
  echo "decode sweep rc=$? at ${SECONDS} s"
fi
if [[ " $STEPS " == *" w1 "* ]] && fits $((ROUNDS * 2 * 75)) w1; then
  B_ARGS="--kv-cache-dtype fp8" ROUNDS=$ROUNDS OUT="$OUT/w1" bash benchmarks/ab_w1.sh > "$OUT/w1.log" 2>&1
  echo "w1 rc=$? at ${SECONDS} s"
fi
if [[ " $STEPS " == *" w1fp8layout "* ]] && fits $((ROUNDS * 2 * 75)) w1fp8layout; then
  A_ENV="PAGEDLLM_V_TRANSPOSED=0" A_ARGS="--kv-cache-dtype fp8" B_ARGS="--kv-cache-dtype fp8" ROUNDS=$ROUNDS \
    OUT="$OUT/w1fp8layout" bash benchmarks/ab_w1.sh > "$OUT/w1fp8layout.log" 2>&1
  echo "w1fp8layout rc=$? at ${SECONDS} s"
fi
if [[ " $STEPS " == *" w1bf16layout "* ]] && fits $((ROUNDS * 2 * 75)) w1bf16layout; then
  B_ENV="PAGEDLLM_V_TRANSPOSED=1" ROUNDS=$ROUNDS OUT="$OUT/w1bf16layout" bash benchmarks/ab_w1.sh \
    > "$OUT/w1bf16layout.log" 2>&1
  echo "w1bf16layout rc=$? at ${SECONDS} s"
fi
echo; grep -A20 "=== decode kernel" "$OUT/sweep.log" 2>/dev/null
echo "=== W1 tok/s, A = bf16 KV, B = FP8 KV ==="; grep -E "round|median" "$OUT/w1.log" 2>/dev/null
for f in w1fp8layout w1bf16layout; do
  [ -f "$OUT/$f.log" ] && { echo "=== $f: A = V head_dim-major, B = key-major ==="; grep -E "median" "$OUT/$f.log"; }
done
tar czf /tmp/fp8kv_gpu_logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/fp8kv_gpu_logs.tgz "$OUT/"
