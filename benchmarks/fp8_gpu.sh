#!/usr/bin/env bash
# FP8 on the GPU in one call: the FP8 kernel tests, the GEMM sweep / crossover
# (benchmarks/fp8_bench.py), then W2 (Llama-3.1-8B, batch 1) with bf16 and FP8 weights and W1
# (Qwen3-0.6B, 256 requests) with a bf16 and an FP8 KV cache, side by side. Logs to $OUT.
#   bash benchmarks/fp8_gpu.sh [tests] [bench] [w2] [w1]      # default: all
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-./fp8-gpu-out}
mkdir -p "$OUT"
STEPS=${*:-tests bench w2 w1}
PY=${PYTHON:-python3}
for step in $STEPS; do
  case $step in
    tests) $PY -m pytest -q -x tests/gpu/test_fp8_gpu.py 2>&1 | tail -4 | tee "$OUT/tests.log" ;;
    bench) $PY benchmarks/fp8_bench.py > "$OUT/bench.log" 2>&1; tail -11 "$OUT/bench.log" ;;
    w2) for q in bf16 fp8; do
          extra=""; [ $q = fp8 ] && extra="--quantization fp8"
          $PY benchmarks/latency.py --peer none --iters 3 $extra --output-json "$OUT/w2_$q.json" > "$OUT/w2_$q.log" 2>&1
          echo "W2 $q: $(grep -E '^pagedllm:' "$OUT/w2_$q.log")"; grep -E "precision:|Error" "$OUT/w2_$q.log" | head -3
        done ;;
    w1) for kv in auto fp8; do
          $PY benchmarks/throughput.py --workload w1 --peer none --kv-cache-dtype $kv --output-json "$OUT/w1_$kv.json" > "$OUT/w1_$kv.log" 2>&1
          echo "W1 kv=$kv: $(grep -iE 'tok/s' "$OUT/w1_$kv.log" | tail -2 | tr '\n' ' ')"; grep -E "KV cache plan|Error" "$OUT/w1_$kv.log" | head -2
        done ;;
  esac
done
