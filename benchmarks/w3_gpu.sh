#!/usr/bin/env bash
# W3 on the GPU: pagedllm's OpenAI server with Llama-3.1-8B (random weights, bf16), and
# benchmarks/serve.py at several request rates: 1024-token prompts, 128 output tokens
# (ignore_eos), streaming. Results (JSON per rate) and the server's log go to $OUT (default
# ./w3-gpu-out). The device image lacks fastapi/uvicorn/pydantic/httpx: install them first
# (the device README's wheel recipe), e.g. PYTHONPATH=/tmp/site.
#
#   bash benchmarks/w3_gpu.sh [NUM_PROMPTS] [RATES...]      # default: 200 prompts at 4 16 inf
#   MODEL=benchmarks/configs/tiny-llama PYTHON=.venv/bin/python bash benchmarks/w3_gpu.sh 8 inf   # CPU smoke
#   SERVER_ARGS="--quantization fp8 --kv-cache-dtype fp8" bash benchmarks/w3_gpu.sh 200 inf        # FP8
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./w3-gpu-out}
mkdir -p "$OUT"
N=${1:-200}
shift || true
RATES=${*:-4 16 inf}
MODEL=${MODEL:-benchmarks/configs/llama-3.1-8b}
PY=${PYTHON:-python3}
TOK=$(MODEL="$MODEL" $PY - <<'PY'
import os, sys, tempfile
sys.path.insert(0, "benchmarks")
import common
from transformers import AutoConfig
cfg = AutoConfig.from_pretrained(os.environ["MODEL"])
print(common.synthetic_tokenizer(cfg.vocab_size, common.first_eos(cfg), tempfile.mkdtemp()))
PY
)
$PY -m pagedllm.entrypoints.openai_api_server --model "$MODEL" --load-format dummy --tokenizer "$TOK" \
    --max-model-len 4096 --host 127.0.0.1 --port 8000 ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    if $PY -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code != 200)" 2>/dev/null; then
        break
    fi
    kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/server.log"; exit 1; }
    sleep 1
done
grep -iE "startup|KV cache|captured|plan" "$OUT/server.log" | head -8 || true
seed=0
for r in $RATES; do
    seed=$((seed + 1))
    $PY benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts "$N" --random-input-len 1024 \
        --random-output-len 128 --ignore-eos --request-rate "$r" --seed "$seed" --quiet \
        --goodput ttft:500 tpot:50 --label "pagedllm-h200-rate$r" --result-json "$OUT/w3-h200-rate$r.json"
done
