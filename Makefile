# Every target creates .venv when it is missing and installs the project into it.
# CPU torch is pinned and installed first: a bare `torch` requirement would pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test test-all test-fast bench gpu-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install "$(TORCH_PIN)"
	$(BIN)/pip install -e ".[test,hf]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m orchestrator run examples/mnist_allreduce.yaml --result-json runs/last_result.json

# test: every feature at least once end to end (tests marked `full` are left to test-all).
# test-all: everything but the opt-in long soaks (what .ci/run runs). Neither stops at the first
# failure: one late failure must not hide the rest.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not full" --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not ray and not e2e"

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --quick

# gpu-check: the replica's allreduce step on one GPU, in-process, no Ray (benchmarks/gpu_check.py,
# docs/clusters.md "GPU check"). It needs a CUDA build of torch, which the venv's pinned CPU torch
# is not, so it installs nothing: the venv's python when there is one, else $(PY) (e.g. a GPU
# machine with torch and numpy installed system-wide: `make gpu-check PY=python`).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))

gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --device cuda

clean:
	rm -rf $(VENV) runs mlruns mlflow.db
