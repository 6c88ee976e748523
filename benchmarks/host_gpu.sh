#!/usr/bin/env bash
# The host-path check on one H200 (issue 13), in one call of about 8 minutes:
#   1. tests/gpu/test_engine_gpu.py (greedy-exact vs transformers, CUDA graphs, logprobs)
#   2. profile_gpu.py --load w1: host ms per step at 256 running (target <= 3.5)
#   3. throughput.py --workload w1 (target >= 25,000 output tok/s; was 18,529)
#   4. latency.py (W2, Llama-3.1-8B batch 1; not slower than 4.78 ms/token)
#   5. w3_gpu.sh 200 16 (TTFT P99 <= 908 ms, TPOT P99 <= 23.9 ms)
#   6. throughput.py --workload w1 --peer hf-cb (the transformers peer; cut when time runs out)
# Server wheels (fastapi, uvicorn, pydantic, ...) travel in .whl/ beside this tree.
# Logs go to $OUT (default ./host-gpu-out); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-./host-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
T0=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - T0) )); }

timeout 100 $PY -m pytest -q -x tests/gpu/test_engine_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?: $(tail -1 "$OUT/tests.log")" | tee "$OUT/summary.txt"

timeout 90 $PY benchmarks/profile_gpu.py --load w1 > "$OUT/profile_w1.log" 2>&1
echo "profile w1 rc=$?" >> "$OUT/summary.txt"

timeout 80 $PY benchmarks/throughput.py --workload w1 --peer none > "$OUT/w1.log" 2>&1
echo "w1 rc=$?" >> "$OUT/summary.txt"

timeout 70 $PY benchmarks/latency.py > "$OUT/w2.log" 2>&1
echo "w2 rc=$?" >> "$OUT/summary.txt"

OUT="$OUT/w3" PYTHON=$PY timeout 130 bash benchmarks/w3_gpu.sh 200 16 > "$OUT/w3.log" 2>&1
echo "w3 rc=$?" >> "$OUT/summary.txt"

L=$(left)
if [ "$L" -gt 30 ]; then
    timeout "$L" $PY benchmarks/throughput.py --workload w1 --peer hf-cb > "$OUT/w1_peer.log" 2>&1
    echo "w1 with peer rc=$? (limit ${L}s)" >> "$OUT/summary.txt"
fi

echo "==================== host path on the H200 ===================="
cat "$OUT/summary.txt"
echo "--- profile w1 (host ms per step at 256 running; target <= 3.5)"
grep -E "requests running|wall per step|device busy" "$OUT/profile_w1.log"
echo "--- W1 (target >= 25,000 output tok/s)"
grep -iE "tok/s|host ms" "$OUT/w1.log" | tail -6
echo "--- W2 (<= 4.78 ms/token)"
grep -iE "ms/token|ms per|tok/s" "$OUT/w2.log" | tail -4
echo "--- W3 at 16 req/s (TTFT P99 <= 908 ms, TPOT P99 <= 23.9 ms)"
grep -iE "ttft|tpot|throughput|completed" "$OUT/w3.log" | tail -12
echo "--- W1 with the transformers peer"
grep -iE "tok/s|x\b|ratio" "$OUT/w1_peer.log" 2>/dev/null | tail -6
