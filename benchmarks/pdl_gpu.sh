#!/usr/bin/env bash
# Programmatic dependent launch (PAGEDLLM_PDL, kernels/pdl_triton.py) on the H200 in one call
# (about 8 minutes): its GPU tests, then the batch-1 workloads it is for, each with PDL off (0),
# on (1) and on with the GEMVs' weight prefetch (prefetch), alternated round by round:
#   W2 Llama-3.1-8B bf16 and FP8 weights (benchmarks/latency.py, issues 13/14),
#   Qwen3-30B-A3B batch-1 decode (benchmarks/moe_bench.py, issue 15).
# Also the sampler's compile test (the W1 in-run compiles, issue 13). Logs and JSON in $OUT; a
# table last (ms per output token, medians over rounds).
#     OUT=$OUT bash benchmarks/pdl_gpu.sh              # from the repo root; carry tokenizer/
#     ROUNDS=1 STEPS="tests w2" bash benchmarks/pdl_gpu.sh   # STEPS: any of tests w2 moe
set -uo pipefail
OUT=${OUT:-./pdl-gpu-out}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-tests w2 moe}
BUDGET=${BUDGET:-570}   # seconds; a run that could overrun it is skipped
. benchmarks/gpu_common.sh

w2() {  # quant mode round
  fits 45 "w2 $1 $2" || return
  local flag; flag=$([ "$1" = fp8 ] && echo "--quantization fp8")
  PAGEDLLM_PDL=$2 timeout 45 $PY benchmarks/latency.py --peer none --iters 2 $flag \
    --output-json "$OUT/w2_$1_$2_$3.json" > "$OUT/w2_$1_$2_$3.log" 2>&1
  echo "w2 $1 PDL=$2 round $3 rc=$?: $(grep -E '^pagedllm:' "$OUT/w2_$1_$2_$3.log")"
}
moe() {  # mode round
  fits 60 "moe $1" || return
  PAGEDLLM_PDL=$1 timeout 60 $PY benchmarks/moe_bench.py --skip-w1 --skip-peer --skip-kernels \
    --latency-iters 2 --output-json "$OUT/moe_$1_$2.json" > "$OUT/moe_$1_$2.log" 2>&1
  echo "moe PDL=$1 round $2 rc=$?: $(grep -E 'batch 1:' "$OUT/moe_$1_$2.log")"
}
$PY -c "import torch, triton; from pagedllm.kernels._triton import _pdl_supported; \
print('triton', triton.__version__, '- PDL supported here:', _pdl_supported(0))"
if [[ " $STEPS " == *" tests "* ]] && fits 150 tests; then
  timeout 150 $PY -m pytest -q tests/gpu/test_pdl_gpu.py tests/gpu/test_sampling_gpu.py \
    "tests/gpu/test_small_m_gpu.py::test_fused_router_in_the_moe_block" \
    "tests/gpu/test_small_m_gpu.py::test_last_program_reduce_replays_in_cuda_graph" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -6
fi
# rounds outermost: a budget cut leaves whole rounds of every workload, each alternating the modes
for r in $(seq "$ROUNDS"); do
  for mode in 0 1 prefetch; do
    [[ " $STEPS " == *" moe "* ]] && moe $mode "$r"
  done
  for q in bf16 fp8; do
    for mode in 0 1 prefetch; do
      [[ " $STEPS " == *" w2 "* ]] && w2 $q $mode "$r"
    done
  done
done

$PY - "$OUT" <<'PYEOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
def ms(path, key):
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        return None
    return key(r)
rows = {("W2 bf16", m): [ms(p, lambda r: r["rows"][0]["decode_ms_per_token"]) for p in sorted(glob.glob(f"{out}/w2_bf16_{m}_*.json"))]
        for m in ("0", "1", "prefetch")}
rows.update({("W2 FP8", m): [ms(p, lambda r: r["rows"][0]["decode_ms_per_token"]) for p in sorted(glob.glob(f"{out}/w2_fp8_{m}_*.json"))]
             for m in ("0", "1", "prefetch")})
rows.update({("MoE batch 1", m): [ms(p, lambda r: r["ours_latency"]["decode_ms_per_token"])
                                  for p in sorted(glob.glob(f"{out}/moe_{m}_*.json"))] for m in ("0", "1", "prefetch")})
print("\n=== ms per output token, median of rounds (each round's figure) ===")
print(f"{'workload':<14}{'PDL=0':>18}{'PDL=1':>18}{'prefetch':>18}")
for name in ("W2 bf16", "W2 FP8", "MoE batch 1"):
    cells = []
    for m in ("0", "1", "prefetch"):
        v = [x for x in rows[(name, m)] if x is not None]
        cells.append(f"{statistics.median(v):.3f} ({'/'.join(f'{x:.3f}' for x in v)})" if v else "-")
    print(f"{name:<14}" + "".join(f"{c:>18}" for c in cells))
PYEOF
# the device returns only a few files: every log and JSON in one archive
tar czf /tmp/pdl_gpu_logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/pdl_gpu_logs.tgz "$OUT/"
