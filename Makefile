# pagedserve: two commands for a new user (see README.md).
#   make serve   set up .venv, fetch the default model, serve gRPC on 127.0.0.1:50051
#   make test    set up, lint, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on this machine; GPU users: make serve TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url URL'
TORCH_SPEC ?= torch==2.13.0
PIP_EXTRA ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast lint format model bench gpu-check clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard protos/pagedserve/v1/*.proto)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_EXTRA) "$(TORCH_SPEC)" numpy "setuptools>=70" wheel "grpcio-tools==1.85.1"
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

model: setup
	$(PY) -m pagedserve.worker.model_store --model default

serve: model
	$(VENV)/bin/pagedserve serve

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) tools/typecheck.py
	$(PY) tools/lint_imports.py

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint model
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow" $(PYTEST_ARGS)

bench: model
	$(PY) benchmarks/memory/block_manager.py
	$(PY) benchmarks/memory/simulate.py
	$(PY) benchmarks/kernels/kernels.py
	$(PY) benchmarks/serving/serving.py
	$(PY) benchmarks/memory/capacity.py

# The prepared GPU check: runs with the machine's own python (a bare CUDA image: torch,
# triton, pytest, hypothesis, transformers; no venv, Ray, gRPC or model files needed).
# Check it anywhere with: python3 benchmarks/engine/gpu_check.py --cpu-smoke
gpu-check:
	$(PYTHON) benchmarks/engine/gpu_check.py

clean:
	rm -rf build *.egg-info protos/pagedserve/v1/*_pb2*.py protos/pagedserve/v1/*_pb2.pyi
