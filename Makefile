# Two entry points for a fresh machine: `make demo` (kproxy's main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-slow lint bench system-deps

# The native codec accelerator is built by the editable install: rebuild when its source changes.
$(VENV)/.installed: pyproject.toml kproxy/protocol/_accel.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The non-PyPI test tools, from Debian: kcat for the end-to-end tests, promtool (package
# prometheus; no service starts) to lint /metrics. Installed when missing and we may use apt;
# otherwise the tests that need them fail saying so.
system-deps:
	@command -v kcat >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kcat) >/dev/null \
	      || echo "warning: could not install kcat"; \
	  else echo "warning: kcat missing and apt-get unavailable"; fi; }
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      prometheus) >/dev/null || echo "warning: could not install promtool (Debian package prometheus)"; \
	  else echo "warning: promtool missing and apt-get unavailable"; fi; }

demo: $(VENV)/.installed
	$(BIN)/kproxy demo

test: $(VENV)/.installed system-deps
	$(BIN)/python -m pytest -q

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not e2e and not slow"

# The long runs left out of `make test` (bench/attack.py at full size, and the like).
test-slow: $(VENV)/.installed system-deps
	$(BIN)/python -m pytest -q -m slow

lint: $(VENV)/.installed
	$(BIN)/ruff check kproxy tests bench
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/python bench/codec.py
	$(BIN)/python bench/proxy.py
