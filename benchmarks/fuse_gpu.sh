#!/usr/bin/env bash
# The fused decode-step kernel (PAGEDLLM_FUSED_ROPE_KV: q/k norm + rotary + store-KV in one
# kernel; on main, off by default), on one H200, <= 4 minutes (time-guarded):
#   1. correctness: tests/gpu/test_fused_gpu.py's kernel tests (fused rope/norm/store-KV vs its
#      torch reference and the unfused Triton chain; layers)
#   2. W2 (Llama-3.1-8B dummy, batch 1, latency.py --peer none --iters 2): FP8 weights with the
#      option off / on
#   3. benchmarks/fuse_bench.py: us per layer, unfused vs fused, CUDA graphs of 32 layers
#   4. while time is left: W2 bf16 off / on, the FP8 GEMM tests and the engine tests of
#      test_fused_gpu.py (greedy tokens with the option on vs off / vs transformers)
#   a table last. Logs and JSON under $OUT (default ./fuse-gpu-out).
# (The SiLU and RMSNorm folds into the FP8 GEMV this script once A/B'd lost on the H200 and were
# removed: benchmarks/RESULTS.md, seventh session.)
# Run from the repo root:  bash benchmarks/fuse_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-./fuse-gpu-out}
mkdir -p "$OUT"
rm -f "$OUT"/w2_*.json "$OUT"/fuse_bench.json  # no stale figures in the table
PY=${PYTHON:-python3}
T0=$SECONDS
BUDGET=${BUDGET:-232}
left() { echo $((BUDGET - (SECONDS - T0))); }
stamp() { echo "   [$((SECONDS - T0)) s]"; }

echo "== 1. fused kernel tests"
timeout 80 $PY -m pytest -q --durations=3 tests/gpu/test_fused_gpu.py -k "not engine" > "$OUT/tests_fused.log" 2>&1
echo "fused kernel tests rc=$?: $(tail -1 "$OUT/tests_fused.log")"; stamp
grep -E "^FAILED|^ERROR" "$OUT/tests_fused.log" | head -8

w2() {  # name, bf16|fp8, ROPE_KV
  local extra=""; [ "$2" = fp8 ] && extra="--quantization fp8"
  if [ "$(left)" -lt 50 ]; then echo "W2 $1: skipped (time)"; return; fi
  local cap=$(( $(left) - 5 )); [ $cap -gt 80 ] && cap=80
  PAGEDLLM_FUSED_ROPE_KV=$3 timeout $cap $PY benchmarks/latency.py --peer none --iters 2 $extra \
    --output-json "$OUT/w2_$1.json" > "$OUT/w2_$1.log" 2>&1
  echo "W2 $1 rc=$?: $(grep -E '^pagedllm:' "$OUT/w2_$1.log")"; stamp; grep -E "Error" "$OUT/w2_$1.log" | head -2
}
echo "== 2. W2 FP8"
w2 fp8_off fp8 0
w2 fp8_rope fp8 1

echo "== 3. fuse_bench"
if [ "$(left)" -gt 45 ]; then
  OUT=$OUT timeout 45 $PY benchmarks/fuse_bench.py > "$OUT/fuse_bench.log" 2>&1
  echo "fuse_bench rc=$?"; stamp; grep -E "Error" "$OUT/fuse_bench.log" | head -3
else echo "fuse_bench: skipped (time)"; fi

echo "== 4. the rest, while time is left"
w2 bf16_off bf16 0
w2 bf16_rope bf16 1
if [ "$(left)" -gt 25 ]; then
  timeout $(( $(left) - 15 )) $PY -m pytest -q tests/gpu/test_fp8_gpu.py -k "gemm or swap or dispatch or gemv" > "$OUT/tests_fp8.log" 2>&1
  echo "fp8 gemm tests rc=$? (124: out of time): $(tail -1 "$OUT/tests_fp8.log")"; stamp
fi
if [ "$(left)" -gt 25 ]; then
  timeout $(( $(left) - 12 )) $PY -m pytest -q tests/gpu/test_fused_gpu.py -k "engine" > "$OUT/tests_engine.log" 2>&1
  echo "engine tests rc=$? (124: out of time): $(tail -1 "$OUT/tests_engine.log")"; stamp
  grep -E "^FAILED" "$OUT/tests_engine.log" | head -5
fi

$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
p = os.path.join(out, "fuse_bench.json")
if os.path.exists(p):
    r = json.load(open(p))
    print("\n=== fused kernel, us per layer (CUDA graph of 32 layers): unfused -> fused ===")
    for kind, rows in r.items():
        for key, t in rows.items():
            print(f"  {kind:7s} {key:24s} {t['unfused']:7.2f} -> {t['fused']:7.2f}  "
                  f"(saves {(t['unfused'] - t['fused']) * 32 / 1000:+.3f} ms per 32 layers)")
print("\n=== W2 Llama-3.1-8B dummy, batch 1: decode ms/token (median; all iters) ===")
base = {}
for name in ("fp8_off", "fp8_rope", "bf16_off", "bf16_rope"):
    p = os.path.join(out, f"w2_{name}.json")
    if not os.path.exists(p):
        print(f"  {name:10s} (not run)")
        continue
    e = json.load(open(p))["rows"][0]
    ms = e["decode_ms_per_token"]
    ref = base.setdefault(name.split("_")[0], ms)
    print(f"  {name:10s} {ms:7.3f}  {e['decode_ms_all_iters']}  on - off {ms - ref:+.3f} ms")
PYEOF
echo "total $((SECONDS - T0)) s"
