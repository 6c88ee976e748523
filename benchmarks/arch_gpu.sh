#!/bin/bash
# Issue 17 part A on one H200, one call: the new kernel options against their torch references,
# the plain-case attention kernels before/after (main's files from the checkout root), then
# Gemma-2-9B and Phi-3-mini dummy latency + W1-style throughput beside transformers.
# Run from the repo root of the device checkout:  bash .gpu/archa/benchmarks/arch_gpu.sh
MAIN_ROOT=$PWD
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/archa-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
timeout 35 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_archs.py > "$OUT/kernels.log" 2>&1
echo "kernels rc=$? $(tail -1 "$OUT/kernels.log")"
timeout 15 python3 benchmarks/arch_kernels_ab.py --main-root "$MAIN_ROOT" --rounds 2 > "$OUT/ab.log" 2>&1
echo "ab rc=$?"
timeout 60 python3 benchmarks/arch_models_gpu.py --out "$OUT" --max-out 96 --latency-tokens 48 > "$OUT/models.log" 2>&1
echo "models rc=$?"
grep -E "passed|failed|Error" "$OUT/kernels.log" | tail -5
cat "$OUT/ab.log" | tail -8
tail -8 "$OUT/models.log"
