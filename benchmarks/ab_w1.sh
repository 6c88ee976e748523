#!/usr/bin/env bash
# W1 (throughput.py --workload w1) of two trees alternated in one call, A B A B ..., the order
# flipped every round: A = the pagedllm package under $A_PATH (a copy of another commit's
# `pagedllm/`, e.g. `git archive OLD pagedllm | tar -x -C abtree`), B = this tree. Prints each
# run and the medians last. Extra arguments go to throughput.py (e.g. --kv-cache-dtype fp8).
#   A_PATH=abtree ROUNDS=2 OUT=dir bash benchmarks/ab_w1.sh [--kv-cache-dtype fp8]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-./ab-w1-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
A_PATH=$(cd "${A_PATH:?A_PATH: the other tree}" && pwd)
run() {  # name pythonpath round
    PYTHONPATH=$2:$PWD timeout 200 $PY benchmarks/throughput.py --workload w1 --peer none "${@:4}" \
        --output-json "$OUT/w1_$1_$3.json" > "$OUT/w1_$1_$3.log" 2>&1
    echo "$1 round $3 rc=$?: $(grep -E '^pagedllm:' "$OUT/w1_$1_$3.log" | tail -1)"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
    if [ $((r % 2)) = 1 ]; then run A "$A_PATH" "$r" "$@"; run B "$PWD" "$r" "$@"
    else run B "$PWD" "$r" "$@"; run A "$A_PATH" "$r" "$@"; fi
done
$PY - "$OUT" <<'PY'
import glob, json, statistics, sys
def tps(f):
    rows = json.load(open(f))["rows"]
    return next(r["tok_per_s"] for r in rows if r["engine"].startswith("pagedllm"))
res = {k: [tps(f) for f in sorted(glob.glob(f"{sys.argv[1]}/w1_{k}_*.json"))] for k in "AB"}
a, b = (statistics.median(res[k]) if res[k] else float("nan") for k in "AB")
print(f"A (other tree): {[round(x, 1) for x in res['A']]} median {a:.1f}")
print(f"B (this tree):  {[round(x, 1) for x in res['B']]} median {b:.1f}  B/A {b / a:.3f}")
PY
