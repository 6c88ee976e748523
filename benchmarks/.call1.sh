#!/usr/bin/env bash
# untracked: one device call
set -uo pipefail
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "gpu: $gpu"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
OUT=$OUT BUDGET=470 ROUNDS=1 STEPS="tmabench moetma w2tma" bash benchmarks/where_gpu.sh
. benchmarks/gpu_common.sh
timeout $((585 - SECONDS)) python3 -m pytest -q -x tests/gpu/test_wna16_gpu.py tests/gpu/test_fused_moe.py tests/gpu/test_small_m_gpu.py -k tma > $OUT/tmatests.log 2>&1
echo "tmatests rc=$? at $SECONDS s: $(tail -1 $OUT/tmatests.log)"; grep -E "^(FAILED|ERROR)|Error" $OUT/tmatests.log | head -5
