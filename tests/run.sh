#!/usr/bin/env bash
# The whole test suite, as the README runs it on a fresh Debian/Ubuntu machine (as root):
# installs the system tools the tests use for real (tmux, rsync, sshd, gcc for the fake NVML
# library, systemd-analyze), builds .venv with the test extra (and .venv-hf: a CPU torch, transformers
# and peft for the real-Trainer resume test), then runs ruff and pytest.
# A second run installs nothing. Arguments go to pytest: tests/run.sh -k alerts -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/system-deps test
bash .ci/venv test
bash .ci/hf-venv
[ -x .venv-hf/bin/python ] && [ -f .venv-hf/.installed ] && export TSUP_HF_PYTHON="$PWD/.venv-hf/bin/python"
echo "test: ruff"
.venv/bin/ruff check supervisor tests
echo "test: pytest"
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
# pytest exits 5 when it collected nothing: here that means the suite is broken, not "all good".
[ "$rc" -ne 5 ] || echo "tests/run.sh: pytest collected no tests (exit 5)" >&2
exit "$rc"
