#!/usr/bin/env bash
# The decode kernel's tiles on one H200 (issues 13 and 14), in one call. Steps (default: sweep w1):
#   sweep  benchmarks/decode_sweep.py: every (BLOCK_N, warps, stages) checked against torch and
#          timed at W1's shape, bf16 and FP8 caches; the best of each to $OUT/best.json
#   w1     throughput.py --workload w1 with the bf16 KV cache at the default tiles and at the
#          sweep's best, and with the FP8 KV cache at its best and at the default
#   ab     W1 alternated A B A B: A = PAGEDLLM_DECODE_CONFIG=$AB_OLD (default 64,4,2, the tiles
#          before the sweep), B = the default tiles; KV cache $AB_KV (auto)
#   engine tests/gpu/test_engine_gpu.py (greedy-exact against transformers under CUDA graphs: the
#          logits buffer in the head's dtype). It needs SmolLM2's tokenizer, which the device
#          lacks: `.venv/bin/python benchmarks/save_tokenizer.py tokenizer` here, and carry
#          ./tokenizer (ignored) to the device; or set PAGEDLLM_TOKENIZER_DIR
#   order  benchmarks/decode_sweep.py --order-ab: a few tiles with the requests in order and
#          longest first (PAGEDLLM_DECODE_ORDER), bf16 and FP8, W1-like loads
#   w1order  W1 alternated (benchmarks/ab_w1.sh, ROUNDS=${ORDER_ROUNDS:-2}): A with
#          PAGEDLLM_DECODE_ORDER=0, B with it on (the default for 16-bit caches since the eleventh
#          session); KV cache $AB_KV (auto); and the engine tests with it on
#   archs  the GPU tests of the other architectures and MoE (tests/gpu/test_more_architectures_gpu.py,
#          test_fused_moe.py), which had not run with the fused q/k norm + rotary + store-KV default
#   tests  the decode, sampler and FP8 GPU tests (test_kernels.py -k "decode or backend", test_sampling_gpu.py,
#          test_fp8_gpu.py -k "backend or reference or decode")
# Logs to $OUT; the figures are printed as they come, the sweep's table last.
#   BUDGET=480 bash benchmarks/decode_gpu.sh [steps...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-./decode-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-480}
STEPS=${*:-sweep w1}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
best() { $PY -c "import json; print(json.load(open('$OUT/best.json')).get('$1', ''))" 2>/dev/null; }
w1() {  # name kv config
    local name=$1 kv=$2 cfg=$3 t
    t=$(left); [ "$t" -lt 70 ] && { echo "W1 $name: skipped (budget)"; return; }
    PAGEDLLM_DECODE_CONFIG=$cfg timeout $((t - 10)) $PY benchmarks/throughput.py --workload w1 --peer none \
        --kv-cache-dtype "$kv" --output-json "$OUT/w1_$name.json" > "$OUT/w1_$name.log" 2>&1
    echo "W1 $name (kv $kv, config '${cfg:-default}') rc=$?: $(grep -E '^pagedllm:' "$OUT/w1_$name.log" | tail -1)"
    grep -E "host ms per step" "$OUT/w1_$name.log" | tail -1 | cut -c1-200
}
for step in $STEPS; do
    case $step in
        sweep) timeout 300 $PY benchmarks/decode_sweep.py --out "$OUT/best.json" > "$OUT/sweep.log" 2>&1
               echo "sweep rc=$? ($(( $(date +%s) - T0 )) s)" ;;
        w1) w1 bf16_default auto ""
            B=$(best bf16); [ -n "$B" ] && w1 bf16_best auto "$B"
            F=$(best fp8); [ -n "$F" ] && w1 fp8_best fp8 "$F"
            w1 fp8_default fp8 "" ;;
        ab) for r in 1 2; do
                w1 "ab_old_$r" "${AB_KV:-auto}" "${AB_OLD:-64,4,2}"
                w1 "ab_new_$r" "${AB_KV:-auto}" ""
            done ;;
        order) timeout 300 $PY benchmarks/decode_sweep.py --order-ab > "$OUT/order.log" 2>&1
               echo "order sweep rc=$?"; sed -n '/=== decode kernel/,$p' "$OUT/order.log"
               grep -E "bn=(64|128) " "$OUT/order.log" | grep -E "w1-t300|w1-mix" ;;
        w1order) [ -d "$PWD/tokenizer" ] && export PAGEDLLM_TOKENIZER_DIR=${PAGEDLLM_TOKENIZER_DIR:-$PWD/tokenizer}
               PAGEDLLM_DECODE_ORDER=1 timeout $(( $(left) - 5 )) $PY -m pytest -q -x tests/gpu/test_engine_gpu.py \
                   > "$OUT/tests_engine_order.log" 2>&1
               echo "engine tests, decode order on, rc=$?: $(tail -1 "$OUT/tests_engine_order.log")"
               A_ENV=PAGEDLLM_DECODE_ORDER=0 B_ENV=PAGEDLLM_DECODE_ORDER=1 ROUNDS=${ORDER_ROUNDS:-2} OUT=$OUT/w1order bash benchmarks/ab_w1.sh \
                   --kv-cache-dtype "${AB_KV:-auto}" | tail -2 ;;
        archs) [ -d "$PWD/tokenizer" ] && export PAGEDLLM_TOKENIZER_DIR=${PAGEDLLM_TOKENIZER_DIR:-$PWD/tokenizer}
               timeout $(( $(left) - 5 )) $PY -m pytest -q -x tests/gpu/test_more_architectures_gpu.py \
                   tests/gpu/test_fused_moe.py > "$OUT/tests_archs.log" 2>&1
               echo "architecture + MoE GPU tests rc=$?: $(tail -1 "$OUT/tests_archs.log")" ;;
        tests) timeout $(( $(left) - 5 )) $PY -m pytest -q -x tests/gpu/test_kernels.py tests/gpu/test_sampling_gpu.py -k "decode or backend or sample" > "$OUT/tests_decode.log" 2>&1
               echo "decode tests rc=$?: $(tail -1 "$OUT/tests_decode.log")"
               timeout $(( $(left) - 5 )) $PY -m pytest -q -x tests/gpu/test_fp8_gpu.py -k "backend or reference or decode" > "$OUT/tests_fp8.log" 2>&1
               echo "fp8 kv tests rc=$?: $(tail -1 "$OUT/tests_fp8.log")" ;;
        engine) [ -d "$PWD/tokenizer" ] && export PAGEDLLM_TOKENIZER_DIR=${PAGEDLLM_TOKENIZER_DIR:-$PWD/tokenizer}
                timeout $(( $(left) - 5 )) $PY -m pytest -q -x tests/gpu/test_engine_gpu.py > "$OUT/tests_engine.log" 2>&1
                echo "engine tests rc=$?: $(tail -1 "$OUT/tests_engine.log")" ;;
        *) echo "decode_gpu.sh: unknown step $step" >&2; exit 2 ;;
    esac
done
[ -f "$OUT/sweep.log" ] && { echo; sed -n '/=== decode kernel/,$p' "$OUT/sweep.log"; }
echo "total $(( $(date +%s) - T0 )) s"
