# Shortcuts for those who have make; the scripts they call are what the README runs (a fresh
# machine has no make) and each installs what it needs itself:
# make demo   examples/demo.sh: the tiny trainer under train-supervisord, nothing real touched
# make test   tests/run.sh: system tools, .venv with the test extra, ruff, the whole suite
# make lint   ruff only
# make bench  the benchmarks in tests/bench (not part of the suite)
# make venv   .venv with the test extra (what `make test` builds)
# PYTEST_ARGS passes arguments through: make test PYTEST_ARGS="-k alerts -x"

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test lint demo bench clean

venv:
	@bash .ci/venv test

lint: venv
	$(VENV)/bin/ruff check supervisor tests

test:
	@bash tests/run.sh $(PYTEST_ARGS)

demo:
	@bash examples/demo.sh

bench: venv
	@set -e; for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
