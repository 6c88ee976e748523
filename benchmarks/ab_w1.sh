#!/usr/bin/env bash
# W1 (throughput.py --workload w1) of two variants alternated in one call, A B A B ..., the order
# flipped every round (w1_variants.sh with two variants); each run's result and step timeline go to
# $OUT, the medians are printed last. A variant is a tree and an environment:
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
A_PATH=$(cd "${A_PATH:-.}" && pwd)
OUT=${OUT:-./ab-w1-out} ROUNDS=${ROUNDS:-2} exec bash benchmarks/w1_variants.sh \
    "A|${A_ARGS:-}|PYTHONPATH=$A_PATH:$PWD ${A_ENV:-}" "B|${B_ARGS:-}|${B_ENV:-}" -- "$@"
