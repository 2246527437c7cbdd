# Two entry points for a fresh machine: `make demo` (kproxy's main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint bench system-deps

# The native codec accelerator is built by the editable install: rebuild when its source changes.
$(VENV)/.installed: pyproject.toml kproxy/protocol/_accel.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# kcat from Debian for the end-to-end tests (the only non-PyPI test tool). Installed when missing
# and we may use apt; otherwise its tests report it as not installed.
system-deps:
	@command -v kcat >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat) >/dev/null \
	      || echo "warning: could not install kcat"; \
	  else echo "warning: kcat missing and apt-get unavailable"; fi; }

demo: $(VENV)/.installed
	$(BIN)/kproxy demo

test: $(VENV)/.installed system-deps
	$(BIN)/python -m pytest -q

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not e2e"

lint: $(VENV)/.installed
	$(BIN)/ruff check kproxy tests bench
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/python bench/codec.py
	$(BIN)/python bench/proxy.py
