#!/usr/bin/env bash
# W1 (throughput.py --workload w1) of several variants in one call, the order rotated every round;
# each run's result and log go to $OUT, each variant's tok/s and median (and its ratio to the first
# variant's) are printed last. A variant is "name|throughput.py arguments|VAR=value ...":
#   ROUNDS=2 OUT=dir bash benchmarks/w1_variants.sh "bf16||" "gptq|--quantization gptq|" \
#       "accs2|--quantization gptq|PAGEDLLM_KPAIRS_DOTS=accs2" -- --model benchmarks/configs/llama-3.1-8b --skip-tokenizer-init
# Arguments after -- go to every run. This tree is on PYTHONPATH; a variant's own PYTHONPATH=... (another
# tree first) takes its place (ab_w1.sh's A_PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-./w1-variants-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ $# -gt 0 ] && shift
n=${#variants[@]}
for r in $(seq 1 "${ROUNDS:-2}"); do
    for j in $(seq 0 $((n - 1))); do
        IFS='|' read -r name args envs <<< "${variants[$(((j + r - 1) % n))]}"
        # shellcheck disable=SC2086  # the variant's arguments and assignments are meant to split
        env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $envs timeout 200 $PY benchmarks/throughput.py --workload w1 --peer none "$@" $args \
            --output-json "$OUT/w1_${name}_$r.json" > "$OUT/w1_${name}_$r.log" 2>&1
        echo "$name round $r rc=$?: $(grep -E '^pagedllm:' "$OUT/w1_${name}_$r.log" | tail -1)"
    done
done
$PY - "$OUT" "${variants[@]}" <<'PY'
import glob, json, statistics, sys
def tps(f):
    return next(r["tok_per_s"] for r in json.load(open(f))["rows"] if r["engine"].startswith("pagedllm"))
first = None
for v in sys.argv[2:]:
    name = v.split("|")[0]
    res = [tps(f) for f in sorted(glob.glob(f"{sys.argv[1]}/w1_{name}_*.json"))]
    med = statistics.median(res) if res else float("nan")
    first = med if first is None else first
    print(f"{name}: {[round(x, 1) for x in res]} median {med:.1f}  /first {med / first:.3f}")
PY
