#!/usr/bin/env bash
# The fused decode-step kernels (helper "fuse"; on main), on one H200, <= 4 minutes (time-guarded):
#   1. correctness: tests/gpu/test_fused_gpu.py's kernel tests (fused rope/norm/store-KV and the
#      gated FP8 gate_up product vs their torch references and the unfused
#      Triton chain; layers)
#   2. W2 (Llama-3.1-8B dummy, batch 1, latency.py --peer none --iters 2): FP8 weights with all
#      both options off / on (PAGEDLLM_FUSED_ROPE_KV, PAGEDLLM_FUSED_SILU)
#   3. benchmarks/fuse_bench.py: us per layer, unfused vs fused, CUDA graphs of 32 layers
#   4. while time is left: one engine check (FP8, all options on: the same greedy tokens), W2 bf16
#      off / ROPE_KV on, FP8 with each option alone, the
#      existing FP8 GEMM tests (their kernels were refactored) and the engine tests of
#      test_fused_gpu.py (greedy tokens with the options on vs off / vs transformers)
#   a table last. Logs and JSON under $OUT (default ./fuse-gpu-out).
# Run from the repo root:  bash benchmarks/fuse_gpu.sh   (the same as /work/notes/gpu_fuse.sh)
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

w2() {  # name, bf16|fp8, ROPE_KV, SILU
  local extra=""; [ "$2" = fp8 ] && extra="--quantization fp8"
  if [ "$(left)" -lt 50 ]; then echo "W2 $1: skipped (time)"; return; fi
  local cap=$(( $(left) - 5 )); [ $cap -gt 80 ] && cap=80
  PAGEDLLM_FUSED_ROPE_KV=$3 PAGEDLLM_FUSED_SILU=$4 timeout $cap $PY benchmarks/latency.py --peer none --iters 2 $extra \
    --output-json "$OUT/w2_$1.json" > "$OUT/w2_$1.log" 2>&1
  echo "W2 $1 rc=$?: $(grep -E '^pagedllm:' "$OUT/w2_$1.log")"; stamp; grep -E "Error" "$OUT/w2_$1.log" | head -2
}
echo "== 2. W2 FP8"
w2 fp8_off fp8 0 0
w2 fp8_on fp8 1 1

echo "== 3. fuse_bench"
if [ "$(left)" -gt 45 ]; then
  OUT=$OUT timeout 45 $PY benchmarks/fuse_bench.py > "$OUT/fuse_bench.log" 2>&1
  echo "fuse_bench rc=$?"; stamp; grep -E "Error" "$OUT/fuse_bench.log" | head -3
else echo "fuse_bench: skipped (time)"; fi

echo "== 4. the rest, while time is left"
# the engine: FP8 weights, every option on, greedy tokens = options off
if [ "$(left)" -gt 40 ]; then
  timeout 45 $PY -m pytest -q tests/gpu/test_fused_gpu.py -k "test_engine_fused_silu_fp8_greedy" \
    > "$OUT/tests_engine_first.log" 2>&1
  echo "engine check (FP8, all options on) rc=$?: $(tail -1 "$OUT/tests_engine_first.log")"; stamp
fi
w2 bf16_off bf16 0 0
w2 bf16_rope bf16 1 0
w2 fp8_rope fp8 1 0
w2 fp8_silu fp8 0 1
if [ "$(left)" -gt 25 ]; then
  timeout $(( $(left) - 15 )) $PY -m pytest -q tests/gpu/test_fp8_gpu.py -k "gemm or swap or dispatch or gemv" > "$OUT/tests_fp8.log" 2>&1
  echo "existing fp8 gemm tests rc=$? (124: out of time): $(tail -1 "$OUT/tests_fp8.log")"; stamp
fi
if [ "$(left)" -gt 25 ]; then
  timeout $(( $(left) - 12 )) $PY -m pytest -q tests/gpu/test_fused_gpu.py -k "engine and not test_engine_fused_silu_fp8_greedy" \
    > "$OUT/tests_engine.log" 2>&1
  echo "engine tests rc=$? (124: out of time): $(tail -1 "$OUT/tests_engine.log")"; stamp
  grep -E "^FAILED" "$OUT/tests_engine.log" | head -5
fi

$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
p = os.path.join(out, "fuse_bench.json")
if os.path.exists(p):
    r = json.load(open(p))
    print("\n=== fused kernels, us per layer (CUDA graph of 32 layers): unfused -> fused ===")
    for kind, rows in r.items():
        for key, t in rows.items():
            print(f"  {kind:7s} {key:24s} {t['unfused']:7.2f} -> {t['fused']:7.2f}  "
                  f"(saves {(t['unfused'] - t['fused']) * 32 / 1000:+.3f} ms per 32 layers)")
print("\n=== W2 Llama-3.1-8B dummy, batch 1: decode ms/token (median; all iters) ===")
base = {}
for name in ("fp8_off", "fp8_on", "fp8_rope", "fp8_silu", "bf16_off", "bf16_rope"):
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
