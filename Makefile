# Every target creates .venv when it is missing and installs the project into it.
# CPU torch is pinned and installed first: a bare `torch` requirement would pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install "$(TORCH_PIN)"
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m orchestrator run examples/mnist_allreduce.yaml --result-json runs/last_result.json

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not ray and not e2e"

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) runs mlruns mlflow.db
