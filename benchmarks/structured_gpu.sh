#!/usr/bin/env bash
# Structured outputs on one H200 (issue 12): the kernel test, then structured_bench's GPU
# workload (Qwen3-0.6B dummy, 256 requests, U C C U) per variant of SO_VARIANTS (default:
# "default inline"): default = main's default (on a 16-core host: the grammar thread, the matchers in
# 4 worker processes), procs0 = the matchers in the engine process (the grammar thread, grammar_threads()
# fill threads), procs2 / procs8 = 2 or 8 worker processes, fill1 = procs0 with the fill on one thread,
# inline = the grammar work on the engine thread. ~70 s a variant.
#   TOK=DIR (SmolLM2's tokenizer saved) OUT=DIR bash benchmarks/structured_gpu.sh
set -uo pipefail
OUT=${OUT:-./gpu-out}; mkdir -p "$OUT"
TOK=${TOK:-.gpu/tokenizer}
export PAGEDLLM_TOKENIZER_DIR=$PWD/$TOK
timeout 120 python3 -m pytest -q -x tests/gpu/test_sampling_gpu.py > "$OUT/so_tests.log" 2>&1
echo "so tests: $(tail -1 "$OUT/so_tests.log")"
for v in ${SO_VARIANTS:-default inline}; do
  case $v in
    default) envs="";;
    procs0) envs="PAGEDLLM_GRAMMAR_PROCS=0";;
    procs2) envs="PAGEDLLM_GRAMMAR_PROCS=2";;
    procs8) envs="PAGEDLLM_GRAMMAR_PROCS=8";;
    fill1) envs="PAGEDLLM_GRAMMAR_PROCS=0 PAGEDLLM_GRAMMAR_THREADS=1";;
    inline) envs="PAGEDLLM_GRAMMAR_THREAD=0";;
  esac
  env $envs timeout 200 python3 benchmarks/structured_bench.py --workload gpu --tokenizer "$TOK" --rounds 1 \
      --output-json "$OUT/so_$v.json" > "$OUT/so_$v.log" 2>&1
  echo "== structured $v (rc $?)"; grep -E "grammar steps|ratio|tok/s|outputs begin" "$OUT/so_$v.log" | tail -8
done
