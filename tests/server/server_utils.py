"""Settings of the server tests; the server subprocess itself is tests/server_process.py."""

from __future__ import annotations

API_KEY = "test-key"
# The tiny model's server: small KV cache (so usage is visible in /metrics) and short context.
TINY_MAX_MODEL_LEN = 512
TINY_SERVER_ARGS = [
    "--max-model-len", str(TINY_MAX_MODEL_LEN),
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "64",
    "--served-model-name", "tiny",
    "--api-key", API_KEY,
    "--max-request-body-size", "1MiB",
]
