"""The OpenAI-compatible HTTP server (needs the `server` extra: fastapi, uvicorn, pydantic, prometheus-client)."""
