# Two entry points for a fresh machine: `make demo` (kproxy's main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast test-slow test-deep lint bench bench-deps system-deps kerberos-deps monitoring image-deps docs

# The native codec accelerator is built by the editable install: rebuild when its source changes.
# The distribution is kproxy-kafka (`kproxy` on the package index is someone else's): a .venv made
# when it was still called kproxy, or one where that other package went in, loses it first.
# kerberos-deps comes first (order-only: it never makes the venv stale): pip builds gssapi, in the
# dev and kerberos extras, against MIT krb5's headers.
$(VENV)/.installed: pyproject.toml kproxy/protocol/_accel.c kproxy/server/_lane.c | kerberos-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip uninstall --quiet --yes kproxy
	$(BIN)/python -m pip install --quiet -e '.[dev,analytics]'
	touch $@

# From Debian, installed when missing and we may use apt: kcat for the end-to-end tests, promtool
# (package prometheus; no service starts) to lint /metrics, haproxy (the load balancer in front of
# kproxy in the PROXY protocol tests, which run their own in the foreground), softhsm2 (a software
# PKCS#11 token: the tests of kms.pkcs11 initialise their own in a temporary folder), and a Java
# runtime (17 or newer) for PySpark, which `kproxy report` and its tests run on. Otherwise the tests
# that need them fail saying so.
system-deps: kerberos-deps
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	if [ -z "$$v" ] || [ "$$v" -lt 17 ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless \
	      || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless; }) \
	      >/dev/null || echo "warning: could not install openjdk-17-jre-headless"; \
	  else echo "warning: Java 17+ missing and apt-get unavailable (needed by kproxy report)"; fi; fi
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
	@command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      haproxy) >/dev/null || echo "warning: could not install haproxy"; \
	  else echo "warning: haproxy missing and apt-get unavailable"; fi; }
	@command -v softhsm2-util >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      softhsm2) >/dev/null || echo "warning: could not install softhsm2"; \
	  else echo "warning: softhsm2 missing and apt-get unavailable"; fi; }

# MIT Kerberos from Debian, installed when missing and we may use apt: libkrb5-dev (krb5-config and the
# headers pip builds the gssapi package with), and for the Kerberos tests a real KDC: krb5-kdc
# (krb5kdc, kdb5_util), krb5-admin-server (kadmin.local) and krb5-user (kinit, klist). No service is
# started: the tests run their own KDC in a temporary realm. Measured here: about 50 s to install.
kerberos-deps:
	@missing=""; for t in krb5-config krb5kdc kdb5_util kadmin.local kinit; do \
	  command -v $$t >/dev/null 2>&1 || [ -x /usr/sbin/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      libkrb5-dev krb5-kdc krb5-admin-server krb5-user) >/dev/null \
	      || echo "warning: could not install MIT Kerberos (libkrb5-dev krb5-kdc krb5-admin-server krb5-user)"; \
	  else echo "warning:$$missing missing and apt-get unavailable (pip cannot build gssapi without libkrb5-dev)"; fi; fi

demo: $(VENV)/.installed
	$(BIN)/kproxy demo

# Three workers (pytest-xdist) on two cores: much of the suite waits on brokers, clients and timers rather than on a
# core. Each test file runs whole on one worker (see tests/conftest.py).
test: $(VENV)/.installed system-deps
	$(BIN)/python -m pytest -q -n 3

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not e2e and not slow"

# For the image test only (tests/release/test_image.py, in `make test-slow`): podman, runc and
# debootstrap from Debian, installed when missing and we may use apt. `make test` does not need them.
image-deps:
	@for tool in podman runc debootstrap; do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      podman runc debootstrap) >/dev/null || echo "warning: could not install$$missing"; \
	  else echo "warning:$$missing missing and apt-get unavailable (needed by the image test)"; fi; fi

# The long runs left out of `make test`: bench/attack.py at full size, the container image built and
# run with podman (about 90 s cold, 30 s with the base image cached in ~/.cache/kproxy-tests).
test-slow: $(VENV)/.installed system-deps image-deps
	$(BIN)/python -m pytest -q -m slow

# The codec fuzzers and cross-checks with three times the default run's Hypothesis examples
# (tests/budget.py), as many as `make test` drew before 2026-11; about three times their share of it.
test-deep: $(VENV)/.installed
	KPROXY_EXAMPLES=3 $(BIN)/python -m pytest -q -n 2 tests/protocol

lint: $(VENV)/.installed
	$(BIN)/ruff check kproxy tests bench
	$(BIN)/mypy

# The documentation site into site/ (`.venv/bin/mkdocs serve` to read it while writing).
docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict

# HAProxy (Debian), the zero-copy relay bench/proxy.py --broker fake compares kproxy with; only the
# benches need it, not `make test`.
bench-deps:
	@command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      haproxy) >/dev/null || echo "warning: could not install haproxy"; \
	  else echo "warning: haproxy missing and apt-get unavailable (bench/proxy.py --broker fake needs it)"; fi; }

bench: $(VENV)/.installed bench-deps
	$(BIN)/python bench/codec.py
	$(BIN)/python bench/proxy.py
	$(BIN)/python bench/proxy.py --broker fake
	$(BIN)/python bench/big_fetch.py

# The Grafana dashboard built as code, and the chart's copies of it and of the alert rules (Helm reads
# only files inside the chart). tests/monitoring fails when any of them is stale.
monitoring: $(VENV)/.installed
	$(BIN)/python -m kproxy.ops.dashboard --out deploy/monitoring/grafana/kproxy.json \
	  --out helm/kproxy/files/kproxy-dashboard.json
	cp deploy/monitoring/prometheus-rules.yaml helm/kproxy/files/prometheus-rules.yaml
