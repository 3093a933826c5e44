# Shortcuts for those who have make; the scripts they call are what the README runs (a fresh
# machine has no make) and each installs what it needs itself:
# make demo   examples/demo.sh: the tiny trainer under train-supervisord, nothing real touched
# make test   tests/run.sh: system tools, .venv with the test extra, ruff, the whole suite
# make lint   ruff only
# make bench  tests/bench/run.sh: every benchmark in tests/bench with --quick (not part of the suite)
#             BENCH_ARGS="--rounds 5" for a full run
# make venv   .venv with the test extra (what `make test` builds)
# PYTEST_ARGS passes arguments through: make test PYTEST_ARGS="-k alerts -x"

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
BENCH_ARGS ?= --quick

.PHONY: venv test lint demo bench clean

venv:
	@bash .ci/venv test

lint: venv
	$(VENV)/bin/ruff check supervisor tests

test:
	@bash tests/run.sh $(PYTEST_ARGS)

demo:
	@bash examples/demo.sh

bench:
	@bash tests/bench/run.sh $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
