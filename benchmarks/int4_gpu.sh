#!/usr/bin/env bash
# Integer weight-only linears on the GPU in one call: the kernel tests, the correctness check and
# config sweep (benchmarks/wna16_bench.py), then W2 (Llama-3.1-8B, batch 1) with bf16, FP8 and
# int4 weights and W1-style throughput (Llama-3.1-8B, 256 requests) with bf16 and int4 weights,
# side by side. Logs to $OUT.
#   bash benchmarks/int4_gpu.sh [tests] [bench] [bench8] [w2] [w1]      # default: all
#   ... [swaptests] [swap] [w2swap]: the 4-bit swap-AB kernel (PAGEDLLM_WNA16_SWAP=1): its GPU tests,
#   its sweep beside bf16 and the int4 GEMV (wna16_bench.py --swap, ~2 min), W2 int4 with it on
#   ... [gemvptests] [gemvp] [w2gemvp]: the packed 16-bit GEMV (the default; PAGEDLLM_WNA16_GEMV=plain off): its GPU
#   tests, the one-row sweep of it beside the float32 GEMV (wna16_bench.py --rows 1), W2 gptq with
#   and without it, alternated (W2_ROUNDS, default 2)
#   W2_QUANTS="gptq" restricts W2's weights (default: bf16 fp8 gptq); W1_QUANTS likewise (bf16 gptq);
#   W2_ITERS (default 3); W1_ARGS: extra throughput.py options (e.g. a shorter --output-len-range)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-./int4-gpu-out}
mkdir -p "$OUT"
STEPS=${*:-tests bench w2 w1}
PY=${PYTHON:-python3}
LLAMA=benchmarks/configs/llama-3.1-8b
qflag() { [ "$1" = bf16 ] && echo "" || echo "--quantization $1"; }
for step in $STEPS; do
  t0=$(date +%s)
  case $step in
    tests) $PY -m pytest -q -x tests/gpu/test_wna16_gpu.py tests/gpu/test_wna16_nk_gpu.py 2>&1 | tail -4 | tee "$OUT/tests.log" ;;
    bench) $PY benchmarks/wna16_bench.py 2>&1 | tee "$OUT/bench.log" | grep -vE "^  skip|Warning|warn" ;;
    swaptests) $PY -m pytest -q -x tests/gpu/test_wna16_nk_gpu.py -k "swap or int4_nk" 2>&1 | tail -4 | tee "$OUT/swaptests.log" ;;
    swap) $PY benchmarks/wna16_bench.py --swap 2>&1 | tee "$OUT/swap.log" | grep -vE "^  skip|Warning|warn" ;;
    w2swap) PAGEDLLM_WNA16_SWAP=1 $PY benchmarks/latency.py --peer none --iters ${W2_ITERS:-3} --quantization gptq \
              --output-json "$OUT/w2_gptq_swap.json" > "$OUT/w2_gptq_swap.log" 2>&1
            echo "W2 gptq, swap-AB kernel: $(grep -E '^pagedllm:' "$OUT/w2_gptq_swap.log")"
            grep -E "precision|Error|error" "$OUT/w2_gptq_swap.log" | head -3 ;;
    gemvptests) $PY -m pytest -q -x tests/gpu/test_wna16_gpu.py -k gemvp 2>&1 | tail -4 | tee "$OUT/gemvptests.log" ;;
    gemvp) $PY benchmarks/wna16_bench.py --rows 1 --skip-check 2>&1 | tee "$OUT/gemvp.log" | grep -vE "^  skip|Warning|warn" ;;
    w2gemvp) for r in $(seq "${W2_ROUNDS:-2}"); do
               for mode in plain packed; do
                 PAGEDLLM_WNA16_GEMV=$mode $PY benchmarks/latency.py --peer none --iters ${W2_ITERS:-3} --quantization gptq \
                   --output-json "$OUT/w2_gptq_${mode}_$r.json" > "$OUT/w2_gptq_${mode}_$r.log" 2>&1
                 echo "W2 gptq, GEMV $mode, round $r: $(grep -E '^pagedllm:' "$OUT/w2_gptq_${mode}_$r.log")"
               done
             done ;;
    bench8) $PY benchmarks/wna16_bench.py --bits 8 --no-sweep --skip-check --rows 1 64 > "$OUT/bench8.log" 2>&1; tail -12 "$OUT/bench8.log" ;;
    w2) for q in ${W2_QUANTS:-bf16 fp8 gptq}; do
          $PY benchmarks/latency.py --peer none --iters ${W2_ITERS:-3} $(qflag $q) --output-json "$OUT/w2_$q.json" > "$OUT/w2_$q.log" 2>&1
          echo "W2 $q: $(grep -E '^pagedllm:' "$OUT/w2_$q.log")"; grep -E "precision|Error|error" "$OUT/w2_$q.log" | head -3
        done ;;
    w1) for q in ${W1_QUANTS:-bf16 gptq}; do
          $PY benchmarks/throughput.py --workload w1 --model $LLAMA --peer none ${W1_ARGS:-} $(qflag $q) --output-json "$OUT/w1_$q.json" > "$OUT/w1_$q.log" 2>&1
          echo "W1 Llama-3.1-8B $q: $(grep -iE 'tok/s' "$OUT/w1_$q.log" | tail -2 | tr '\n' ' ')"; grep -E "Error|error" "$OUT/w1_$q.log" | head -3
        done ;;
  esac
  echo "[$step: $(( $(date +%s) - t0 )) s]"
done
