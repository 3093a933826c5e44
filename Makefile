# make test   ruff, then the whole suite (slow tests included), in .venv
# make demo   the README's demo: the tiny trainer under train-supervisord, nothing real touched
# make lint   ruff only
# make bench  the benchmarks in tests/bench (not part of the suite)
# make venv   create .venv and install the package with its test extra (done by the others too)
#
# Every target installs what it needs itself; a second run reinstalls nothing unless
# pyproject.toml changed. PYTEST_ARGS passes arguments through: make test PYTEST_ARGS="-k alerts -x"

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test lint demo bench clean deps-test deps-demo

deps-test:
	@bash .ci/system-deps test

deps-demo:
	@bash .ci/system-deps demo

venv: $(STAMP)

# Only when the interpreter is missing (first run, or its base Python went away): a fresh venv.
$(PY):
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "make: needs Python 3.11+; $(PYTHON) is $$($(PYTHON) -V 2>&1)" >&2; exit 1; }
	$(PYTHON) -m venv --clear $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check supervisor tests

# pytest exits 5 when it collected nothing: here that means the suite is broken, not "all good".
test: deps-test lint
	@rc=0; $(PY) -m pytest -q $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

demo: deps-demo venv
	PY=$(abspath $(PY)) bash examples/demo.sh

bench: venv
	@set -e; for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
