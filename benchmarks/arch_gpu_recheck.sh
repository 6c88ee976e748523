#!/bin/bash
# Issue 17, the second H200 call (under 3 minutes): the GPU tests that failed in arch_gpu.sh
# (the bias + GELU kernel read non-constexpr globals; the GELU models through it) and the
# plain-case attention A/B against main's files over more rounds.
# Run from the repo root of the device checkout:  bash .gpu/archs/benchmarks/arch_gpu_recheck.sh
MAIN_ROOT=$PWD
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d "$PWD/tokenizer" ] && export PAGEDLLM_TOKENIZER_DIR=$PWD/tokenizer
OUT=${OUT:-/tmp/archs-out}; mkdir -p "$OUT"
run_tests() {  # name, timeout, pytest arguments...
    local name=$1 t=$2; shift 2
    timeout "$t" python3 -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(grep -E '[0-9]+ (passed|failed|error)' "$OUT/$name.log" | tail -1)"
}
run_tests kernels_ln_gelu 45 tests/gpu/test_kernels_ln_gelu.py
run_tests more_archs_gpu 75 tests/gpu/test_more_architectures_gpu.py -k "gpt2 or gpt_neox or starcoder2"
timeout 45 python3 benchmarks/arch_kernels_ab.py --main-root "$MAIN_ROOT" --rounds 6 > "$OUT/ab.log" 2>&1
echo "ab rc=$?"
echo "== failures"; grep -hE "^(FAILED|ERROR)" "$OUT"/kernels_ln_gelu.log "$OUT"/more_archs_gpu.log | head -20
echo "== kernels A/B"; tail -6 "$OUT/ab.log"
