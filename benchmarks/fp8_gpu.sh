#!/usr/bin/env bash
# FP8 on the GPU in one call: the FP8 kernel tests, the GEMM sweep / crossover
# (benchmarks/fp8_bench.py), then W2 (Llama-3.1-8B, batch 1) with bf16 and FP8 weights and W1
# (Qwen3-0.6B, 256 requests) with a bf16 and an FP8 KV cache, side by side; `table` prints the
# W2 figures and the kernel sums of what ran. Logs and JSON to $OUT.
#   bash benchmarks/fp8_gpu.sh [tests] [bench] [w2] [w1] [profile] [table]   # default: all but profile
# Environment: BENCH_ARGS (fp8_bench.py's, e.g. "--rows 1 2 4 8 16 --no-sweep"), W2_ITERS (3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-./fp8-gpu-out}
mkdir -p "$OUT"
STEPS=${*:-tests bench w2 w1 table}
PY=${PYTHON:-python3}
for step in $STEPS; do
  case $step in
    tests) $PY -m pytest -q -x tests/gpu/test_fp8_gpu.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -4 "$OUT/tests.log" ;;
    bench) OUT=$OUT $PY benchmarks/fp8_bench.py ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
           grep -E "m= |Error" "$OUT/bench.log" | cut -c1-160 ;;
    w2) for q in bf16 fp8; do
          extra=""; [ $q = fp8 ] && extra="--quantization fp8"
          $PY benchmarks/latency.py --peer none --iters "${W2_ITERS:-3}" $extra --output-json "$OUT/w2_$q.json" > "$OUT/w2_$q.log" 2>&1
          echo "W2 $q rc=$?: $(grep -E '^pagedllm:' "$OUT/w2_$q.log")"; grep -E "precision|Error" "$OUT/w2_$q.log" | head -3
        done ;;
    w1) for kv in auto fp8; do
          $PY benchmarks/throughput.py --workload w1 --peer none --kv-cache-dtype $kv --output-json "$OUT/w1_$kv.json" > "$OUT/w1_$kv.log" 2>&1
          echo "W1 kv=$kv: $(grep -iE 'tok/s' "$OUT/w1_$kv.log" | tail -2 | tr '\n' ' ')"; grep -E "KV cache plan|Error" "$OUT/w1_$kv.log" | head -2
        done ;;
    profile) $PY benchmarks/profile_gpu.py --load w2 --quantization fp8 --top 14 > "$OUT/profile_w2_fp8.log" 2>&1
             echo "profile rc=$?"; sed -n '/^w2:/,/^CUDA runtime/p' "$OUT/profile_w2_fp8.log" | cut -c1-120 ;;
    table) $PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
print("\n=== FP8 summary ===")
bench = os.path.join(out, "fp8_bench.json")
if os.path.exists(bench):
    r = json.load(open(bench))
    rows = sorted({int(key.split(":")[1]) for key in r})
    shapes = sorted({key.split(":")[0] for key in r}, key=["qkv", "o", "gate_up", "down", "lm_head"].index)
    print(f"linears, us per layer (CUDA graph of 32 layers): bf16 / old FP8 kernel / fp8_linear now")
    print(f"{'rows':>4} " + " ".join(f"{s:>20}" for s in shapes) + f" {'sum x32 ms (bf16/old/now)':>28}")
    for m in rows:
        cells, tot = [], [0.0, 0.0, 0.0]
        for s in shapes:
            e = r[f"{s}:{m}"]
            v = (e["bf16"], e["old"], e["dispatch"])
            cells.append("/".join(f"{x:.1f}" for x in v))
            tot = [a + 32 * b / 1000 for a, b in zip(tot, v)]
        print(f"{m:>4} " + " ".join(f"{c:>20}" for c in cells) + f" {'/'.join(f'{x:.3f}' for x in tot):>28}")
w2 = {}
for q in ("bf16", "fp8"):
    p = os.path.join(out, f"w2_{q}.json")
    if os.path.exists(p):
        w2[q] = json.load(open(p))["rows"][0]
if w2:
    print("W2 Llama-3.1-8B dummy, batch 1 (latency.py --peer none): decode ms/token (all iters)")
    for q, e in w2.items():
        print(f"  {q:5s} {e['decode_ms_per_token']:.3f}  {e['decode_ms_all_iters']}  TTFT {e['ttft_ms']:.1f} ms")
    if len(w2) == 2:
        print(f"  bf16/fp8 {w2['bf16']['decode_ms_per_token'] / w2['fp8']['decode_ms_per_token']:.2f}x (target: fp8 <= 2.6 ms)")
PYEOF
    ;;
  esac
done
