#!/usr/bin/env bash
# W1 (throughput.py --workload w1) of two variants alternated in one call, A B A B ..., the order
# flipped every round; each run's result and step timeline go to $OUT, the medians are printed
# last. A variant is a tree and an environment:
#   A_PATH  the pagedllm package A imports (a copy of another commit's `pagedllm/`, e.g.
#           `git archive OLD pagedllm | tar -x -C abtree`); default: this tree. B is this tree.
#   A_ENV / B_ENV  "VAR=value ..." set for that variant's runs (e.g. A_ENV=PAGEDLLM_FUSED_ROPE_KV=0)
#   A_ARGS / B_ARGS  throughput.py arguments of that variant only (e.g. B_ARGS="--kv-cache-dtype fp8")
# Extra arguments go to throughput.py in both variants.
#   A_PATH=abtree ROUNDS=2 OUT=dir bash benchmarks/ab_w1.sh [--kv-cache-dtype fp8]
#   A_ENV="PAGEDLLM_DECODE_CONFIG=64,4,3" ROUNDS=3 bash benchmarks/ab_w1.sh
#   B_ARGS="--kv-cache-dtype fp8" ROUNDS=2 bash benchmarks/ab_w1.sh     # FP8 KV (B) / bf16 KV (A)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-./ab-w1-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
A_PATH=$(cd "${A_PATH:-.}" && pwd)
run() {  # name pythonpath "VAR=value ..." round args...
    local own; own=$([ "$1" = A ] && echo "${A_ARGS:-}" || echo "${B_ARGS:-}")
    # shellcheck disable=SC2086  # the assignments and the variant's arguments are meant to split
    env PYTHONPATH="$2:$PWD" $3 timeout 200 $PY benchmarks/throughput.py --workload w1 --peer none "${@:5}" $own \
        --output-json "$OUT/w1_$1_$4.json" > "$OUT/w1_$1_$4.log" 2>&1
    echo "$1 round $4 rc=$?: $(grep -E '^pagedllm:' "$OUT/w1_$1_$4.log" | tail -1)"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
    if [ $((r % 2)) = 1 ]; then run A "$A_PATH" "${A_ENV:-}" "$r" "$@"; run B "$PWD" "${B_ENV:-}" "$r" "$@"
    else run B "$PWD" "${B_ENV:-}" "$r" "$@"; run A "$A_PATH" "${A_ENV:-}" "$r" "$@"; fi
done
$PY - "$OUT" <<'PY'
import glob, json, statistics, sys
def tps(f):
    rows = json.load(open(f))["rows"]
    return next(r["tok_per_s"] for r in rows if r["engine"].startswith("pagedllm"))
res = {k: [tps(f) for f in sorted(glob.glob(f"{sys.argv[1]}/w1_{k}_*.json"))] for k in "AB"}
a, b = (statistics.median(res[k]) if res[k] else float("nan") for k in "AB")
print(f"A: {[round(x, 1) for x in res['A']]} median {a:.1f}")
print(f"B: {[round(x, 1) for x in res['B']]} median {b:.1f}  B/A {b / a:.3f}")
PY
