#!/usr/bin/env bash
# Where the open issues' workloads spend a step, on the H200 in one call (about 9 minutes):
# kernel profiles of Qwen3-30B-A3B at batch 1 (issue 15), W2 with 4-bit gptq weights (issue 19)
# and W1 with an FP8 KV cache (issue 14); the decode kernel's longest-first order against request
# order (decode_sweep.py --order-ab, bf16 and FP8 caches); W1 with an FP8 cache in request order
# (A) and longest first (B, PAGEDLLM_DECODE_ORDER=1) alternated. More steps, not in the default:
# moeprof0 (the MoE profile with PDL off, whose kernels then do not overlap: their own times),
# moemerge (Qwen3-30B-A3B batch 1, the decode reduce kernel (A) against the last split merging (B,
# PAGEDLLM_DECODE_LAST_REDUCE=1), alternated),
# pdltests (tests/gpu/test_pdl_gpu.py), moetree (A the tree at $A_PATH, B this one), w3 (W3 at inf,
# bf16 then FP8 weights + FP8 KV; the server's wheels installed first), moesweep (moe_bench.py
# --small-sweep), w2 (latency.py bf16 / fp8 / gptq; $W2_LOADS picks), moeenvs (Qwen3-30B-A3B batch 1 in each of
# $MOE_VARIANTS, rotated by round), w2prof0 (W2 bf16's profile, PDL off), w1kv (W1 bf16 KV (A) against FP8 KV (B), ab_w1.sh),
# maxnreg (decode_sweep.py --maxnreg-ab), w1maxnreg (W1 FP8 KV: the default (A) against the decode
# kernel capped at 96 registers (B), five CTAs an SM), w3prof (profiles of Llama-3.1-8B's prefill-heavy first steps, bf16 and FP8 + FP8 KV: where W3's
# 1.4x must come from), w1int4 (W1 on Llama-3.1-8B: bf16 (A) against dummy gptq 4-bit weights (B), issue 19's 0.9x),
# int4kp (wna16_bench.py: the K-packed kpairs GEMM), w1int4pairs (W1 gptq with PAGEDLLM_WNA16_GEMM=pairs),
# int4tests (tests/gpu/test_wna16_gpu.py and test_wna16_nk_gpu.py), swaptests (its swap GEMM and dispatch cases), int4gemm (wna16_bench.py --swap at $INT4GEMM_ROWS, default 64 256), w1int4swap (w1int4 with PAGEDLLM_WNA16_SWAP=1
# PAGEDLLM_WNA16_GEMM=swap: the tensor-core W4A16 GEMM), w2int4swap (W2 gptq: K-packed (A) against
# the N-major layout, PAGEDLLM_WNA16_SWAP=1, its one-row gemvn (B)), w2prefetch (W2 gptq: gemvp (A) against
# PAGEDLLM_WNA16_PREFETCH=1, the next tile's words loaded first (B)), gemv1 (wna16_bench.py --rows 1: gemvp's
# tiles, split-K and loop stages), w2gemv (W2 gptq: PAGEDLLM_WNA16_PREFETCH=1 (the register prefetch), =3 (the
# cp.async pipeline), PAGEDLLM_WNA16_PDL=0 (gemvp without PDL, on by default)), w2tiles (W2 gptq:
# A the tree at $A_PATH, B this one, C this one with PAGEDLLM_WNA16_PDL=1; $ROUNDS rounds alternated), w3act
# (W3 at inf: bf16, FP8 + FP8 KV with PAGEDLLM_FUSED_ACT_FP8=0, FP8 + FP8 KV; W3ACT_ORDER may add fp8_norm:
# PAGEDLLM_FUSED_NORM_FP8=1), moebuckets (Qwen3-30B-A3B batch 1: A default (context buckets), B PAGEDLLM_GRAPH_CONTEXT_BUCKETS=0), w1kvoff (W1 with an FP8
# cache: K as it is, PAGEDLLM_FP8_KV_OFFSET=0 (A), against K less its offset, the default (B)), w1int4dots (W1 gptq: A kpairs as it is, B
# PAGEDLLM_KPAIRS_DOTS=$KPAIRS_DOTS, default accs), w1int4prof (W1 gptq's decode steps profiled: what kpairs and x's permutation take),
# kpermtests (the GPU tests of the steps-permuted K-packed layout and of kpairs from 2 rows), kpermbench (wna16_bench.py --kperm: wna16_linear on the
# plain and the steps-permuted layout at 1-256 rows), w1kperm (W1 gptq: A the plain layout, PAGEDLLM_WNA16_KPERM=0, B the default),
# w2kperm (W2 gptq at one row: A the steps-permuted layout, the default, B the plain one), kpfrom (wna16_bench.py at 2-47 rows: the few-row Triton kernels' default
# against kpairs' 16- / 32- / 64-row tiles), w1kpfrom (W1 gptq: A kpairs from 48 rows, B PAGEDLLM_WNA16_KPAIRS_FROM=$KPFROM,
# default 5), w2greedy (W2 gptq: A default, B PAGEDLLM_GREEDY_TRITON=0, torch's argmax), argmaxtests (the fused
# argmax's engine test), w2gptqprof0 (W2 gptq's profile, PDL off), w2pdl (W2 gptq: A default, B PAGEDLLM_WNA16_PDL=0),
# stream (benchmarks/stream_bench.py: streaming the int4 words alone), w2dtype (W2 gptq: A bf16, B fp16 -- gemvp's
# fp16 path issues ~9% fewer instructions a word: whether that shows in time), w2tree (W2 gptq: A this tree, B the
# tree at $A_PATH, alternated by round), gemvptests (gemvp's GPU tests), w2fp16prof0 (W2 gptq fp16's profile, PDL off), l2bench
# (benchmarks/l2_bench.py: a few-row linear's weight cold, warm in L2, prefetched), w1int4accs (W1 Llama-3.1-8B: bf16 (A)
# against gptq with PAGEDLLM_KPAIRS_DOTS=$KPAIRS_DOTS, default accs (B): issue 19's ratio with the four accumulators),
# w1int4sk (the same with PAGEDLLM_KPAIRS_STREAM_K=1 and $W1INT4_ENV: kpairs' stream-K), sktests (its GPU tests),
# kpmodes (benchmarks/kpairs_modes.py: kpairs' 128-row tiles chained and with two accumulators, 64 x 256 tiles of
# one warpgroup at 3 / 2 stages; the dots
# modes' GPU tests), moepre (Qwen3-30B-A3B batch 1: A the defaults, B
# PAGEDLLM_MOE_PRELOAD=0: the MoE down kernel's routing and first expert tile loaded after its wait), preloadtests
# (the MoE preload's GPU tests: the chain with it off, the engine's tokens with PDL), defaulttests (the GPU tests
# of the defaults: kpairs, the 4-bit dispatch and engine, gemvp's prefetch, PDL, the MoE kernels), w2gemvpcfg (W2
# gptq at gemvp configs that split the projections so that more of their weights load before the PDL wait;
# $W2GEMVP_CFGS), moebucket512 (Qwen3-30B-A3B batch 1: decode graphs at a 512-token bound too), w2bucket256 (W2 gptq: a 256 bound), moegucfg and moedowncfg (Qwen3-30B-A3B batch 1 at the small MoE kernels' gate/up or down tiles;
# $MOEGU_CFGS, $MOEDOWN_CFGS), moeswapcfg (Qwen3-30B-A3B batch 1 at swap-AB configs for q/k/v and o; $MOESWAP_CFGS),
# ropetests (the decode kernel doing qkv_rope's work: its GPU tests; gemvp's dispatch and engine tests), moerope
# and w2rope (Qwen3-30B-A3B batch 1 / W2 gptq: A the defaults, B PAGEDLLM_FUSED_ROPE_DECODE=0), moepreload and
# w2preload (the same, B PAGEDLLM_DECODE_PRELOAD=0: the decode kernel's first KV tile after its wait), trace (kernel
# timelines with PDL on: Qwen3-30B-A3B batch 1 (at moe_bench.py's 4,096-token bound), W2 gptq and W2 bf16 (at
# latency.py's 400), each kernel charged what it adds to a step by benchmarks/trace_path.py; TRACE_LOADS picks).
# Logs in one archive in $OUT; a summary last.
#     OUT=$OUT bash benchmarks/where_gpu.sh
#     STEPS="moeprof w1order" bash benchmarks/where_gpu.sh   # any of moeprof w2int4prof w1fp8prof order w1order
#                                                             # moeprof0 pdltests moetree moemerge w3 moesweep w1kv
set -uo pipefail
OUT=${OUT:-./where-gpu-out}
ROUNDS=${ROUNDS:-1}
STEPS=${STEPS:-moeprof w2int4prof w1fp8prof order w1order}
BUDGET=${BUDGET:-570}
. benchmarks/gpu_common.sh
step() { [[ " $STEPS " == *" $1 "* ]] && fits "$2" "$1"; }
if [[ " $STEPS " == *" trace "* ]]; then  # what each kernel adds to a step when PDL overlaps them
  limit=220  # a fresh machine compiles each load's kernels: the first gets the most
  for v in ${TRACE_LOADS:-moe w2gptq w2bf16}; do
    fits "$limit" "trace $v" || continue
    case $v in moe) a="--model benchmarks/configs/qwen3-30b-a3b --max-model-len 4096";;
      w2gptq) a="--quantization gptq --max-model-len 400";; *) a="--max-model-len 400";; esac
    # shellcheck disable=SC2086  # the load's arguments are meant to split
    timeout "$limit" $PY benchmarks/profile_gpu.py --load w2 --skip-steps 10 --steps 6 --top 14 --trace "$OUT/trace_$v.json" \
      $a > "$OUT/trace_$v.log" 2>&1; echo "trace $v rc=$? at ${SECONDS} s"; limit=180
    $PY benchmarks/trace_path.py "$OUT/trace_$v.json" --top 26 > "$OUT/trace_${v}_path.txt" 2>&1 && rm -f "$OUT/trace_$v.json"
  done
fi
if step moeprof 120; then
  timeout 150 $PY benchmarks/profile_gpu.py --load w2 --model benchmarks/configs/qwen3-30b-a3b --skip-steps 10 \
    --steps 10 --top 22 > "$OUT/moeprof.log" 2>&1; echo "moeprof rc=$? at ${SECONDS} s"
fi
if step moeprof0 120; then
  PAGEDLLM_PDL=0 timeout 150 $PY benchmarks/profile_gpu.py --load w2 --model benchmarks/configs/qwen3-30b-a3b \
    --skip-steps 10 --steps 10 --top 22 > "$OUT/moeprof0.log" 2>&1; echo "moeprof0 rc=$? at ${SECONDS} s"
fi
# a call's first run of a load compiles its kernels (Triton's disk cache is empty on a fresh machine): W2's first
# run hit a 45 s limit in most calls of the thirty-fifth and thirty-sixth sessions, so the first of each gets more
first_moe=100 first_w2=100
moe() {  # name env round (env may set PYTHONPATH=another tree's root)
  local limit=${first_moe:-60}
  fits "$limit" "moe $1 $3" || return
  first_moe=
  env $2 timeout "$limit" $PY benchmarks/moe_bench.py --skip-w1 --skip-peer --skip-kernels --latency-iters 2 \
    --output-json "$OUT/moe_$1_$3.json" > "$OUT/moe_$1_$3.log" 2>&1
  echo "moe $1 round $3 rc=$?: $(grep -E 'batch 1:' "$OUT/moe_$1_$3.log")"
}
moevariants() {  # step name:VAR=value,VAR=value ...: Qwen3-30B-A3B batch 1 in each environment, the order rotated by round
  [[ " $STEPS " == *" $1 "* ]] || return
  local step=$1 v
  shift
  for r in $(seq "$ROUNDS"); do
    for j in $(seq 0 $(($# - 1))); do
      v=${*:$(((j + r - 1) % $# + 1)):1}
      moe "${step}_${v%%:*}" "$(echo "${v#*:}" | tr ',' ' ')" "$r"
    done
  done
}
moeab() {  # step B's-environment: the defaults (A) against B, alternated (A B, then B A)
  moevariants "$1" "A:" "B:$(echo "$2" | tr ' ' ',')"
}
if step pdltests 150; then
  timeout 150 $PY -m pytest -q tests/gpu/test_pdl_gpu.py > "$OUT/pdltests.log" 2>&1
  echo "pdltests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/pdltests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pdltests.log" | head
fi
# A_PATH: a tree whose pagedllm/ is another commit's (git archive OLD pagedllm | tar -x -C abtree)
if [[ " $STEPS " == *" moetree "* ]] && [ -d "${A_PATH:-}" ]; then
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then moe moetree_A "PYTHONPATH=$(cd "$A_PATH" && pwd):$PWD" "$r"; moe moetree_B "" "$r"
    else moe moetree_B "" "$r"; moe moetree_A "PYTHONPATH=$(cd "$A_PATH" && pwd):$PWD" "$r"; fi
  done
fi
moeab moemerge PAGEDLLM_DECODE_LAST_REDUCE=1
moeab moebuckets PAGEDLLM_GRAPH_CONTEXT_BUCKETS=0  # B: decode graphs for max_model_len only (32 splits and a reduce kernel at batch 1)
if step defaulttests 300; then  # the defaults' GPU tests: kpairs (accs2 in its tiles of up to 128 rows), the
  # dispatch and the engine on the 4-bit layouts, gemvp's register prefetch, PDL, the MoE kernels
  timeout 300 $PY -m pytest -q tests/gpu/test_wna16_gpu.py tests/gpu/test_pdl_gpu.py tests/gpu/test_fused_moe.py \
    -k "kpairs and not dots and not stream_k and not kpairs_kperm or kperm_dispatch or linear_dispatch or cuda_graph \
        or steps_permuted or gemvp_prefetch or pdl or fused or align or topk or small_path" \
    > "$OUT/defaulttests.log" 2>&1
  echo "defaulttests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/defaulttests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/defaulttests.log" | head
fi
if step ropetests 200; then  # the decode kernel doing qkv_rope's work (on by default): its kernel,
  # graph and engine tests; and gemvp_config's tiles through the 4-bit dispatch, graphs and engine
  timeout 200 $PY -m pytest -q tests/gpu/test_decode_rope_gpu.py tests/gpu/test_wna16_gpu.py \
    -k "decode_rope or rope_in_decode or linear_dispatch or under_cuda_graph or kperm_dispatch or steps_permuted" \
    > "$OUT/ropetests.log" 2>&1
  echo "ropetests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/ropetests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/ropetests.log" | head
fi
if step preloadtests 170; then  # the MoE down kernel's preload (on by default): the chain without it, the engine
  timeout 170 $PY -m pytest -q tests/gpu/test_pdl_gpu.py tests/gpu/test_fused_moe.py > "$OUT/preloadtests.log" 2>&1
  echo "preloadtests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/preloadtests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/preloadtests.log" | head
fi
moeab moepre PAGEDLLM_MOE_PRELOAD=0  # the MoE down kernel's routing and first expert tile after its PDL wait
moeab moerope PAGEDLLM_FUSED_ROPE_DECODE=0  # B: q/k norm + rotary + store-KV in their own kernel again
moeab moepreload PAGEDLLM_DECODE_PRELOAD=0  # B: the decode kernel's first KV tile after its PDL wait (A: before, the default)
# moeenvs: Qwen3-30B-A3B batch 1 in each of $MOE_VARIANTS ("name:VAR=value,VAR=value ..."; a PYTHONPATH=tree:$PWD
# runs another tree), the order rotated by round
# shellcheck disable=SC2086  # one word a variant
moevariants moeenvs ${MOE_VARIANTS:-}
if step moesweep 200; then  # the small MoE kernels' tiles (the gate/up kernel's split-K among them)
  timeout 200 $PY benchmarks/moe_bench.py --skip-latency --skip-w1 --skip-peer --small-sweep \
    --output-json "$OUT/moesweep.json" > "$OUT/moesweep.log" 2>&1; echo "moesweep rc=$? at ${SECONDS} s"
fi
if step w2int4prof 90; then
  timeout 110 $PY benchmarks/profile_gpu.py --load w2 --quantization gptq --steps 30 --top 18 \
    > "$OUT/w2int4prof.log" 2>&1; echo "w2int4prof rc=$? at ${SECONDS} s"
fi
if step w1fp8prof 90; then
  timeout 110 $PY benchmarks/profile_gpu.py --load w1 --kv-cache-dtype fp8 --skip-steps 40 --steps 12 --top 16 \
    > "$OUT/w1fp8prof.log" 2>&1; echo "w1fp8prof rc=$? at ${SECONDS} s"
fi
if step w1int4prof 120; then  # W1 Llama-3.1-8B gptq's decode steps (256 running): kpairs, x's permutation, the rest
  timeout 140 $PY benchmarks/profile_gpu.py --load w1 --model benchmarks/configs/llama-3.1-8b --quantization gptq \
    --skip-steps 40 --steps 12 --top 20 > "$OUT/w1int4prof.log" 2>&1; echo "w1int4prof rc=$? at ${SECONDS} s"
fi
if step order 130; then
  timeout 140 $PY benchmarks/decode_sweep.py --order-ab > "$OUT/order.log" 2>&1; echo "order rc=$? at ${SECONDS} s"
fi
if step w1order $((ROUNDS * 2 * 75)); then
  A_ARGS="--kv-cache-dtype fp8" B_ARGS="--kv-cache-dtype fp8" B_ENV="PAGEDLLM_DECODE_ORDER=1" ROUNDS=$ROUNDS \
    OUT="$OUT/w1order" bash benchmarks/ab_w1.sh > "$OUT/w1order.log" 2>&1; echo "w1order rc=$? at ${SECONDS} s"
fi
if step maxnreg 120; then  # the decode kernel's tiles under register caps (a fifth FP8 CTA an SM at 96)
  timeout 120 $PY benchmarks/decode_sweep.py --maxnreg-ab > "$OUT/maxnreg.log" 2>&1; echo "maxnreg rc=$? at ${SECONDS} s"
fi
if step w1maxnreg $((ROUNDS * 2 * 75)); then  # W1 with an FP8 cache: the default (A) against maxnreg 96 (B)
  A_ARGS="--kv-cache-dtype fp8" B_ARGS="--kv-cache-dtype fp8" B_ENV="PAGEDLLM_DECODE_CONFIG=128,4,3,96" ROUNDS=$ROUNDS \
    OUT="$OUT/w1maxnreg" bash benchmarks/ab_w1.sh > "$OUT/w1maxnreg.log" 2>&1; echo "w1maxnreg rc=$? at ${SECONDS} s"
fi
if step w1kv $((ROUNDS * 2 * 75)); then
  B_ARGS="--kv-cache-dtype fp8" ROUNDS=$ROUNDS OUT="$OUT/w1kv" bash benchmarks/ab_w1.sh > "$OUT/w1kv.log" 2>&1
  echo "w1kv rc=$? at ${SECONDS} s"
fi
if step w1kvoff $((ROUNDS * 2 * 75)); then  # W1 with an FP8 cache: K as it is (A) against K less its offset (B)
  A_ARGS="--kv-cache-dtype fp8" B_ARGS="--kv-cache-dtype fp8" A_ENV=PAGEDLLM_FP8_KV_OFFSET=0 ROUNDS=$ROUNDS \
    OUT="$OUT/w1kvoff" bash benchmarks/ab_w1.sh > "$OUT/w1kvoff.log" 2>&1
  echo "w1kvoff rc=$? at ${SECONDS} s"; grep -E "median" "$OUT/w1kvoff.log"
fi
if step w1int4 $((ROUNDS * 2 * 200)); then  # issue 19's W1: Llama-3.1-8B, 256 requests, bf16 (A) against dummy gptq 4-bit (B)
  B_ARGS="--quantization gptq" ROUNDS=$ROUNDS OUT="$OUT/w1int4" bash benchmarks/ab_w1.sh \
    --model benchmarks/configs/llama-3.1-8b --skip-tokenizer-init > "$OUT/w1int4.log" 2>&1
  echo "w1int4 rc=$? at ${SECONDS} s"
fi
w1int4env() {  # name B's-environment: issue 19's W1 ratio, bf16 (A) against gptq with that environment (B)
  step "$1" $((ROUNDS * 2 * 100)) || return
  B_ARGS="--quantization gptq" B_ENV="$2" ROUNDS=$ROUNDS OUT="$OUT/$1" bash benchmarks/ab_w1.sh \
    --model benchmarks/configs/llama-3.1-8b --skip-tokenizer-init > "$OUT/$1.log" 2>&1
  echo "$1 rc=$? at ${SECONDS} s"; grep -E "median" "$OUT/$1.log"
}
if step kpmodes 180; then  # kpairs_modes.py (its default modes, or $KPMODES) and the dots modes' GPU tests
  # shellcheck disable=SC2086  # the modes are meant to split
  timeout 90 $PY benchmarks/kpairs_modes.py ${KPMODES:+--modes $KPMODES} > "$OUT/kpmodes.log" 2>&1
  echo "kpmodes rc=$?"; cat "$OUT/kpmodes.log"
  timeout 90 $PY -m pytest -q tests/gpu/test_wna16_gpu.py -k "kpairs_dots or kpairs_kperm" > "$OUT/kpdots.log" 2>&1
  echo "kpdots rc=$? at ${SECONDS} s: $(tail -1 "$OUT/kpdots.log")"; grep -E "^(FAILED|ERROR)" "$OUT/kpdots.log" | head
fi
if step sktests 150; then  # kpairs' stream-K against the reference at Llama-3.1-8B's shapes (twice: counters reset)
  timeout 150 $PY -m pytest -q tests/gpu/test_wna16_gpu.py -k "stream_k" > "$OUT/sktests.log" 2>&1
  echo "sktests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/sktests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/sktests.log" | head
fi
w1int4env w1int4accs "PAGEDLLM_KPAIRS_DOTS=${KPAIRS_DOTS:-accs}"  # kpairs' four accumulators
w1int4env w1int4sk "PAGEDLLM_KPAIRS_STREAM_K=1 ${W1INT4_ENV:-}"  # kpairs' stream-K (and $W1INT4_ENV)
if step w1int4dots $((ROUNDS * 2 * 100)); then  # W1 gptq: kpairs' chained dots (A) against $KPAIRS_DOTS (B)
  A_ARGS="--quantization gptq" B_ARGS="--quantization gptq" B_ENV=PAGEDLLM_KPAIRS_DOTS=${KPAIRS_DOTS:-accs} \
    ROUNDS=$ROUNDS OUT="$OUT/w1int4dots" bash benchmarks/ab_w1.sh --model benchmarks/configs/llama-3.1-8b \
    --skip-tokenizer-init > "$OUT/w1int4dots.log" 2>&1
  echo "w1int4dots rc=$? at ${SECONDS} s"; grep -E "median" "$OUT/w1int4dots.log"
fi
if step kpermtests 240; then  # the steps-permuted layout on every kernel, CUDA graphs; kpairs from 2 rows
  timeout 240 $PY -m pytest -q -x tests/gpu/test_wna16_gpu.py -k "kperm or kpairs_from" > "$OUT/kpermtests.log" 2>&1
  echo "kpermtests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/kpermtests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/kpermtests.log" | head
fi
if step gemvptests "${GEMVPTESTS_S:=240}"; then  # gemvp against its reference (groups, split-K, ragged K, both layouts, prefetch bit for bit)
  timeout "$GEMVPTESTS_S" $PY -m pytest -q tests/gpu/test_wna16_gpu.py -k "gemvp or kperm_kernels or split_k or under_cuda_graph" \
    > "$OUT/gemvptests.log" 2>&1
  echo "gemvptests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/gemvptests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gemvptests.log" | head
fi
if step argmaxtests 100; then  # greedy tokens equal transformers' with the fused argmax
  timeout 100 $PY -m pytest -q tests/gpu/test_engine_gpu.py -k "fused_argmax" > "$OUT/argmaxtests.log" 2>&1
  echo "argmaxtests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/argmaxtests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/argmaxtests.log" | head
fi
if step w2fp16prof0 70; then  # W2 gptq with fp16 activations by kernel, PDL off (against w2gptqprof0: why fp16 loses)
  PAGEDLLM_PDL=0 timeout 70 $PY benchmarks/profile_gpu.py --load w2 --quantization gptq --dtype float16 --steps 30 \
    --top 16 > "$OUT/w2fp16prof0.log" 2>&1; echo "w2fp16prof0 rc=$? at ${SECONDS} s"
fi
if step w2gptqprof0 70; then  # W2 gptq's step by kernel with PDL off (each kernel's own time)
  PAGEDLLM_PDL=0 timeout 70 $PY benchmarks/profile_gpu.py --load w2 --quantization gptq --steps 30 --top 16 \
    > "$OUT/w2gptqprof0.log" 2>&1; echo "w2gptqprof0 rc=$? at ${SECONDS} s"
fi
if step kpermbench 150; then  # wna16_linear per projection and row count on each layout (gather included)
  OUT="$OUT" timeout 150 $PY benchmarks/wna16_bench.py --kpairs-only --no-sweep --skip-check --kperm \
    --rows 1 16 64 160 256 > "$OUT/kpermbench.log" 2>&1
  echo "kpermbench rc=$? at ${SECONDS} s"; grep -A6 "^wna16_linear, ms" "$OUT/kpermbench.log"
fi
if step w1kperm $((ROUNDS * 2 * 100)); then  # W1 gptq: the plain K-packed layout (A) against the steps-permuted one (B)
  A_ARGS="--quantization gptq" B_ARGS="--quantization gptq" A_ENV=PAGEDLLM_WNA16_KPERM=0 \
    ROUNDS=$ROUNDS OUT="$OUT/w1kperm" bash benchmarks/ab_w1.sh --model benchmarks/configs/llama-3.1-8b \
    --skip-tokenizer-init > "$OUT/w1kperm.log" 2>&1
  echo "w1kperm rc=$? at ${SECONDS} s"; grep -E "median" "$OUT/w1kperm.log"
fi
if step kpfrom 170; then  # 2-47 rows: gemvp / the dot GEMM (what runs there now) against kpairs' small tiles
  OUT="$OUT" timeout 170 $PY benchmarks/wna16_bench.py --kpairs-only --skip-check --no-sweep \
    --rows 2 4 8 16 24 32 47 > "$OUT/kpfrom.log" 2>&1
  echo "kpfrom rc=$? at ${SECONDS} s"; grep -A9 "^sum over" "$OUT/kpfrom.log"
fi
if step w1kpfrom $((ROUNDS * 2 * 100)); then  # W1 gptq: kpairs from 48 rows (A) against from $KPFROM rows (B)
  A_ARGS="--quantization gptq" B_ARGS="--quantization gptq" A_ENV=PAGEDLLM_WNA16_KPAIRS_FROM=48 \
    B_ENV=PAGEDLLM_WNA16_KPAIRS_FROM=${KPFROM:-5} \
    ROUNDS=$ROUNDS OUT="$OUT/w1kpfrom" bash benchmarks/ab_w1.sh --model benchmarks/configs/llama-3.1-8b \
    --skip-tokenizer-init > "$OUT/w1kpfrom.log" 2>&1
  echo "w1kpfrom rc=$? at ${SECONDS} s"; grep -E "median" "$OUT/w1kpfrom.log"
fi
if step int4tests 200; then  # the 4-bit GPU tests: the swap GEMM, gemvn, PTX == plain, dispatch, CUDA graphs
  timeout 200 $PY -m pytest -q tests/gpu/test_wna16_gpu.py tests/gpu/test_wna16_nk_gpu.py > "$OUT/int4tests.log" 2>&1
  echo "int4tests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/int4tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/int4tests.log" | head
fi
if step swaptests 240; then  # the swap GEMM at 48-512 rows on every projection, the pairs kernels, the dispatch
  timeout 240 $PY -m pytest -q tests/gpu/test_wna16_gpu.py tests/gpu/test_wna16_nk_gpu.py -k "swap_gemm or dispatch or pairs" > "$OUT/swaptests.log" 2>&1
  echo "swaptests rc=$? at ${SECONDS} s: $(tail -1 "$OUT/swaptests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/swaptests.log" | head
fi
if step int4gemm 200; then  # the 4-bit swap-AB kernel as a GEMM at 64 / 256 rows against dequantize + cuBLAS and bf16
  # shellcheck disable=SC2086  # the rows are meant to split
  OUT="$OUT" timeout 200 $PY benchmarks/wna16_bench.py --swap --rows ${INT4GEMM_ROWS:-64 256} --skip-check --budget-s 150 \
    > "$OUT/int4gemm.log" 2>&1; echo "int4gemm rc=$? at ${SECONDS} s"
fi
if step w1int4swap $((ROUNDS * 2 * 200)); then  # W1 Llama-3.1-8B: bf16 (A) against gptq, N-major layout + the swap GEMM (B)
  B_ARGS="--quantization gptq" B_ENV="PAGEDLLM_WNA16_SWAP=1 PAGEDLLM_WNA16_GEMM=swap" ROUNDS=$ROUNDS \
    OUT="$OUT/w1int4swap" bash benchmarks/ab_w1.sh --model benchmarks/configs/llama-3.1-8b --skip-tokenizer-init \
    > "$OUT/w1int4swap.log" 2>&1; echo "w1int4swap rc=$? at ${SECONDS} s"
fi
if step int4kp 200; then  # the K-packed layout's kpairs GEMM against dequantize + cuBLAS and bf16 (64 / 256 rows)
  OUT="$OUT" timeout 200 $PY benchmarks/wna16_bench.py --rows 64 256 --skip-check --kpairs-only > "$OUT/int4kp.log" 2>&1
  echo "int4kp rc=$? at ${SECONDS} s"; grep -A4 "^sum over" "$OUT/int4kp.log"; grep -E "WRONG" "$OUT/int4kp.log" | head -3
fi
if step w1int4pairs $((ROUNDS * 2 * 200)); then  # W1 Llama-3.1-8B: bf16 (A) against gptq (default K-packed layout) + kpairs (B)
  B_ARGS="--quantization gptq" B_ENV="PAGEDLLM_WNA16_GEMM=pairs" ROUNDS=$ROUNDS OUT="$OUT/w1int4pairs" \
    bash benchmarks/ab_w1.sh --model benchmarks/configs/llama-3.1-8b --skip-tokenizer-init > "$OUT/w1int4pairs.log" 2>&1
  echo "w1int4pairs rc=$? at ${SECONDS} s"; grep -E "round|median" "$OUT/w1int4pairs.log"
fi
w2run() {  # name env round latency.py-arguments...: W2 (latency.py) in that environment
  local name=$1 environment=$2 r=$3 limit=${first_w2:-45}
  shift 3
  fits "$limit" "$name $r" || return
  first_w2=
  # shellcheck disable=SC2086  # the assignments are meant to split
  env $environment timeout "$limit" $PY benchmarks/latency.py --peer none --iters 2 "$@" \
    --output-json "$OUT/${name}_$r.json" > "$OUT/${name}_$r.log" 2>&1
  echo "$name round $r rc=$?: $(grep -E '^pagedllm:' "$OUT/${name}_$r.log")"
}
w2ab() {  # name B's-environment latency.py-arguments [B's-extra-arguments]: W2 with the defaults (A) against B,
  [[ " $STEPS " == *" $1 "* ]] || return  # alternated by round (A B, then B A)
  for r in $(seq "$ROUNDS"); do
    for v in $([ $((r % 2)) = 1 ] && echo "A B" || echo "B A"); do
      # shellcheck disable=SC2046,SC2086  # the arguments are meant to split
      w2run "$1_$v" "$([ $v = B ] && echo "$2")" "$r" $3 $([ $v = B ] && echo "${4:-}")
    done
  done
}
w2ab w2int4swap PAGEDLLM_WNA16_SWAP=1 "--quantization gptq"  # W2 gptq: K-packed gemvp against the N-major gemvn
w2ab w2prefetch PAGEDLLM_WNA16_PREFETCH=1 "--quantization gptq"  # W2 gptq: gemvp against its next-tile prefetch
w2ab w2kperm PAGEDLLM_WNA16_KPERM=0 "--quantization gptq"  # W2 gptq: gemvp on the steps-permuted (the default) against the plain layout
w2ab w2pdl PAGEDLLM_WNA16_PDL=0 "--quantization gptq"  # W2 gptq: gemvp under PDL (the default) against without
w2ab w2rope PAGEDLLM_FUSED_ROPE_DECODE=0 "--quantization gptq"  # W2 gptq: B rotary + store-KV in their own kernel
w2ab w2preload PAGEDLLM_DECODE_PRELOAD=0 "--quantization gptq"  # W2 gptq: B the decode's first KV tile after its wait
w2ab w2greedy PAGEDLLM_GREEDY_TRITON=0 "--quantization gptq"  # W2 gptq: the fused sampler's argmax against torch's
[ -d "${A_PATH:-}" ] && w2ab w2tree "PYTHONPATH=$(cd "$A_PATH" && pwd):$PWD" "--quantization gptq"  # W2 gptq: this tree (A) against $A_PATH's (B)
w2ab w2dtype "" "--quantization gptq" "--dtype float16"  # W2 gptq: bf16 (A) against fp16 (B): is gemvp issue-bound?
w2gptq() { w2run "$1" "$2" "$3" --quantization gptq; }  # name env round: W2 gptq in that environment
cfgvariants() {  # step runner VAR "name=value|...": the runner (moe, w2gptq) at the defaults (A) and at each
  [[ " $STEPS " == *" $1 "* ]] || return  # VAR=value, the order rotated by round (values may hold , and ;)
  local step=$1 runner=$2 var=$3 v j r cfgs
  IFS='|' read -r -a cfgs <<< "A=|$4"
  for r in $(seq "$ROUNDS"); do
    for j in $(seq 0 $((${#cfgs[@]} - 1))); do
      v=${cfgs[$(((j + r - 1) % ${#cfgs[@]}))]}
      "$runner" "${step}_${v%%=*}" "$var=${v#*=}" "$r"
    done
  done
}
# Whole decode steps at other tiles under PDL (the sweeps timed each product alone, without PDL; under PDL a
# program's first tile loads before its wait, so splits that leave each program fewer tiles put more of the
# weight ahead of it). W2 gptq, gemvp (wna16_triton.gemvp_config; the thirty-sixth session's: o, down and gate/up
# each in one wave of 32-column tiles): q/k/v is 96 column tiles of 64 split 2 ways (192 programs at 128
# registers, 2 an SM); here 32-column ones split 2 (384 at 66-68, 3 an SM) or at 4 warps and 512 inputs (384, 8 an SM);
# and o split 3 as down now is (384 programs, one wave, against 256 split 2)
cfgvariants w2gemvpcfg w2gptq PAGEDLLM_GEMVP_CONFIG "${W2GEMVP_CFGS:-q32=6144,4096:32,1024,8,2,2|q4w=6144,4096:32,512,4,2,2\
|o3=4096,4096:32,1024,8,2,3}"
# Qwen3-30B-A3B batch 1, the small MoE kernels (fused_moe_small_triton.tile_overrides; the H200 sweep's bests,
# each kernel alone: gate/up 64 x 128, 4 warps, 4 stages, 96 programs on 132 SMs; down 64 x 128, 4 warps, 3
# stages, one expert a program, 256 programs): gate/up over more SMs, down in fewer programs
# Qwen3-30B-A3B batch 1: the default context buckets (its 128-384-token contexts replay the 1,024 bound's 8
# decode splits) against a 512 bound too (4 splits), and 256 and 512 (2 splits while the context fits 256)
cfgvariants moebucket512 moe PAGEDLLM_GRAPH_CONTEXT_BUCKETS "${MOEBUCKET_CFGS:-b512=512,1024,4096|b256=256,512,1024,4096}"
# W2 gptq (max_model_len 400: 4 decode splits of Llama's 8 kv heads, 32 programs; 6.97 us a layer exposed in the
# thirty-first session's trace): a 256-token bound too, its first 128 output tokens in 2 splits
cfgvariants w2bucket256 w2gptq PAGEDLLM_GRAPH_CONTEXT_BUCKETS "${W2BUCKET_CFGS:-b256=256}"
cfgvariants moegucfg moe PAGEDLLM_MOE_GATE_UP_CONFIG "${MOEGU_CFGS:-gu32=1536,2048:32,128,4,4|gu32s3=1536,2048:32,128,4,3\
|gu16=1536,2048:16,256,2,3}"
cfgvariants moedowncfg moe PAGEDLLM_MOE_DOWN_CONFIG "${MOEDOWN_CFGS:-d128=2048,768:128,128,4,3,1|d32=2048,768:32,128,4,3,1}"
# (block_n,block_k,split_k,warps,stages). The twenty-sixth session's variants (q/k/v split 2 or 4, o split 8 or 2)
# all lost; here the columns narrower, unsplit: q/k/v 32 wide (160 programs, 2 an SM) and o 32 wide split 4 (256, 3 an SM);
# the fused router (128 experts, 64 wide split 8: 16 programs) in 32 programs of 32 or 8 of 128 (one n tile)
cfgvariants moeswapcfg moe PAGEDLLM_SWAP_CONFIG "${MOESWAP_CFGS:-qkv32=5120,2048:32,256,1,4,4|o32=2048,4096:32,256,4,4,3\
|r32=128,2048:32,128,8,4,3|r128=128,2048:128,128,8,4,4}"
if step l2bench 60; then  # whether a few-row linear gains from its weight in L2, and the side stream's prefetch
  timeout 60 $PY benchmarks/l2_bench.py > "$OUT/l2bench.log" 2>&1; echo "l2bench rc=$? at ${SECONDS} s"; cat "$OUT/l2bench.log"
fi
if step stream 100; then  # pure streaming of W2's int4 words: gemvp's pattern, contiguous column blocks, one flat range
  timeout 100 $PY benchmarks/stream_bench.py > "$OUT/stream.log" 2>&1
  echo "stream rc=$? at ${SECONDS} s"; sed -n '/^best per/,$p' "$OUT/stream.log"
fi
if step gemv1 170; then  # gemvp's one-row tiles, split-K and loop stages over the four projections (wna16_bench.py)
  OUT="$OUT" timeout 170 $PY benchmarks/wna16_bench.py --rows 1 --skip-check > "$OUT/gemv1.log" 2>&1
  echo "gemv1 rc=$? at ${SECONDS} s"; grep -E "us/layer|WRONG" "$OUT/gemv1.log" | cut -c1-150
fi
if [[ " $STEPS " == *" w2gemv "* ]]; then  # W2 gptq: the register prefetch (so PDL) or the cp.async pipeline on every shape, gemvp without PDL
  for v in PAGEDLLM_WNA16_PREFETCH=1 PAGEDLLM_WNA16_PREFETCH=3 PAGEDLLM_WNA16_PDL=0; do
    fits 45 "w2gemv $v" || continue
    n=${v#PAGEDLLM_WNA16_}; n=${n/=/}
    env "$v" timeout 45 $PY benchmarks/latency.py --peer none --iters 2 --quantization gptq \
      --output-json "$OUT/w2gemv_$n.json" > "$OUT/w2gemv_$n.log" 2>&1
    echo "w2gemv $v rc=$?: $(grep -E '^pagedllm:' "$OUT/w2gemv_$n.log")"
  done
fi
if [[ " $STEPS " == *" w2tiles "* ]] && [ -d "${A_PATH:-}" ]; then  # W2 gptq: A the tree at $A_PATH, B this one, C this one
  for r in $(seq "$ROUNDS"); do  # with PAGEDLLM_WNA16_PDL=1; alternated (the order reversed every other round)
    order="A B C"; [ $((r % 2)) = 0 ] && order="C B A"
    for v in $order; do
      fits 45 "w2tiles $v" || continue
      case $v in A) e="PYTHONPATH=$A_PATH:$PYTHONPATH";; B) e="PAGEDLLM_WNA16_PDL=0";; C) e="PAGEDLLM_WNA16_PDL=1";; esac
      env "$e" timeout 45 $PY benchmarks/latency.py --peer none --iters 2 --quantization gptq \
        --output-json "$OUT/w2tiles_${v}_$r.json" > "$OUT/w2tiles_${v}_$r.log" 2>&1
      echo "w2tiles $v round $r rc=$?: $(grep -E '^pagedllm:' "$OUT/w2tiles_${v}_$r.log")"
    done
  done
fi
if [[ " $STEPS " == *" w2 "* ]]; then  # W2 Llama-3.1-8B batch 1: bf16, FP8 weights, dummy gptq 4-bit weights
  for q in ${W2_LOADS:-bf16 fp8 gptq}; do
    fits 45 "w2 $q" || continue
    flag=$([ $q = bf16 ] || echo "--quantization $q")
    timeout 45 $PY benchmarks/latency.py --peer none --iters 2 $flag --output-json "$OUT/w2_$q.json" \
      > "$OUT/w2_$q.log" 2>&1
    echo "w2 $q rc=$?: $(grep -E '^pagedllm:' "$OUT/w2_$q.log")"
  done
fi
if step w3prof 200; then  # issue 14's W3: Llama-3.1-8B's first steps of 256 requests (prefill-heavy), bf16 and FP8 + FP8 KV
  for v in bf16 fp8; do
    args=$([ $v = fp8 ] && echo "--quantization fp8 --kv-cache-dtype fp8")
    timeout 95 $PY benchmarks/profile_gpu.py --load w1 --model benchmarks/configs/llama-3.1-8b --skip-steps 2 \
      --steps 12 --top 18 $args > "$OUT/w3prof_$v.log" 2>&1; echo "w3prof $v rc=$? at ${SECONDS} s"
  done
fi
if step w2prof0 60; then
  PAGEDLLM_PDL=0 timeout 60 $PY benchmarks/profile_gpu.py --load w2 --steps 30 --top 16 > "$OUT/w2prof0.log" 2>&1
  echo "w2prof0 rc=$? at ${SECONDS} s"
fi
if step w3 200; then  # needs the server's packages (the device README's wheel recipe, PYTHONPATH=/tmp/site)
  for v in bf16 fp8; do
    args=$([ $v = fp8 ] && echo "--quantization fp8 --kv-cache-dtype fp8")
    SERVER_ARGS="$args" OUT="$OUT/w3_$v" timeout 100 bash benchmarks/w3_gpu.sh 200 inf > "$OUT/w3_$v.log" 2>&1
    echo "w3 $v rc=$? at ${SECONDS} s"
  done
fi
if [[ " $STEPS " == *" w3act "* ]]; then  # W3 at inf: bf16, FP8 + FP8 KV with PAGEDLLM_FUSED_ACT_FP8=0, FP8 + FP8 KV
  for v in ${W3ACT_ORDER:-bf16 fp8_unfused fp8}; do  # (the server's packages needed, as for w3; fp8_norm:
    fits 110 "w3act $v" || continue                 # FP8 + FP8 KV with PAGEDLLM_FUSED_NORM_FP8=1 too)
    args=$([ $v = bf16 ] || echo "--quantization fp8 --kv-cache-dtype fp8")
    case $v in fp8_unfused) e=PAGEDLLM_FUSED_ACT_FP8=0;; fp8_norm) e=PAGEDLLM_FUSED_NORM_FP8=1;; *) e=PAGEDLLM_FUSED_ACT_FP8=1;; esac
    env "$e" SERVER_ARGS="$args" OUT="$OUT/w3act_$v" timeout 110 bash benchmarks/w3_gpu.sh 200 inf > "$OUT/w3act_$v.log" 2>&1
    echo "w3act $v rc=$? at ${SECONDS} s: $(grep -iE "total token|output token" "$OUT/w3act_$v.log" | tr -s ' ' | head -2 | tr '\n' ';')"
  done
fi
for v in moe w2gptq w2bf16; do
  [ -f "$OUT/trace_${v}_path.txt" ] && { echo "=== trace $v ==="; grep -E "^wall|^without" "$OUT/trace_$v.log"; cut -c1-90,111- "$OUT/trace_${v}_path.txt"; }
done
for f in moeprof moeprof0 w2int4prof w1fp8prof w2prof0 w2gptqprof0 w2fp16prof0 w3prof_bf16 w3prof_fp8; do
  [ -f "$OUT/$f.log" ] && { echo "=== $f ==="; grep -E "wall per step|device busy" "$OUT/$f.log";
    grep -A14 "calls/step" "$OUT/$f.log" | cut -c1-50,80-; }
done
echo; grep -A12 "=== decode kernel" "$OUT/order.log" 2>/dev/null
echo "=== W1 FP8 KV: A request order, B longest first ==="; grep -E "round|median" "$OUT/w1order.log" 2>/dev/null
[ -f "$OUT/moesweep.log" ] && { echo "=== small MoE kernels, 1 token ==="; grep -E "T=1 (small|grouped)" "$OUT/moesweep.log" | sort -t' ' -k1,1 | head -40; }
for v in bf16 fp8; do
  [ -f "$OUT/w3_$v.log" ] && echo "=== W3 inf $v: $(grep -iE "total|output token" "$OUT/w3_$v.log" | tr -s ' ' | head -3 | tr '\n' ';')"
done
echo "=== W1: A bf16 KV, B FP8 KV ==="; grep -E "round|median" "$OUT/w1kv.log" 2>/dev/null
echo "=== W1 FP8 KV: A default, B decode maxnreg 96 ==="; grep -E "round|median" "$OUT/w1maxnreg.log" 2>/dev/null
[ -f "$OUT/maxnreg.log" ] && { echo "=== decode under register caps ==="; grep -A12 "=== decode kernel" "$OUT/maxnreg.log"; }
echo "=== W1 Llama-3.1-8B: A bf16, B gptq 4-bit ==="; grep -E "round|median" "$OUT/w1int4.log" 2>/dev/null
echo "=== W1 Llama-3.1-8B: A bf16, B gptq N-major + swap GEMM ==="; grep -E "round|median" "$OUT/w1int4swap.log" 2>/dev/null
[ -f "$OUT/int4gemm.log" ] && { echo "=== int4 GEMM (us a layer; sums) ==="; grep -A4 "^sum over" "$OUT/int4gemm.log"; }
echo "=== Qwen3-30B-A3B batch 1 (ms/token): moe_<step>_<variant>_<round> (moeab steps: A the defaults, B the step's switch) ==="
for f in "$OUT"/moe_*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -h "batch 1:" "$f" | cut -c1-60)"; done
tar czf /tmp/where_gpu_logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/where_gpu_logs.tgz "$OUT/"  # one file back (the device returns few)
