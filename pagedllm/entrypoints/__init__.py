"""Entry points: the `pagedllm` CLI and the OpenAI-compatible server."""
