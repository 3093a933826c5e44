#!/usr/bin/env bash
# The whole test suite, as the README runs it on a fresh Debian/Ubuntu machine (as root):
# installs the system tools the tests use for real (tmux, rsync, sshd, gcc for the fake NVML
# library, systemd-analyze), builds .venv with the test extra (and .venv-hf: a CPU torch, transformers
# and peft for the real-Trainer resume test; .venv-recipes: the Kubernetes, dstack and SkyPilot parsers
# the recipes are checked with), then runs ruff and pytest.
# A second run installs nothing. Arguments go to pytest: tests/run.sh -k alerts -x
#
# tests/run.sh --quick [pytest args]: the developer's loop. Only .venv (the other installs are for the
# real servers and trainers the quick set does not start), ruff, and the files named in tests/quick.txt:
# the pure decisions, parsers, golden words and layout/docs checks, no daemon, tmux, S3 or trainer.
# CI (.ci/run) runs this script with no --quick: everything.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
if [ "$quick" = 1 ]; then
  bash .ci/venv test
  # tests/quick.txt names files, not folders: a file keeps its name when it moves between wings.
  # (a command substitution, not < <(...): its exit status stops the script under set -e)
  list="$(.venv/bin/python - <<'PY'
import sys
from pathlib import Path
names = [ln.split("#")[0].strip() for ln in Path("tests/quick.txt").read_text().splitlines()]
where = {}
for p in Path("tests").rglob("test_*.py"):
    if "bench" not in p.parts:
        where.setdefault(p.name, []).append(p.as_posix())
bad = [n for n in names if n and len(where.get(n, [])) != 1]
if bad:
    sys.exit(f"tests/quick.txt: not found, or found twice, under tests/: {' '.join(bad)}")
print("\n".join(where[n][0] for n in names if n))
PY
  )"
  mapfile -t files <<<"$list"
  # no file would make pytest run its testpaths: the whole suite
  [ -n "$list" ] || { echo "tests/run.sh: tests/quick.txt names no test file" >&2; exit 2; }
  echo "test: ruff"
  .venv/bin/ruff check supervisor tests
  echo "test: pytest --quick (${#files[@]} files of tests/quick.txt)"
  rc=0
  .venv/bin/python -m pytest -q -m "not slow" "${files[@]}" "$@" || rc=$?
  [ "$rc" -ne 5 ] || echo "tests/run.sh: pytest collected no tests (exit 5)" >&2
  exit "$rc"
fi
bash .ci/system-deps test
bash .ci/venv test
bash .ci/hf-venv
[ -x .venv-hf/bin/python ] && [ -f .venv-hf/.installed ] && export TSUP_HF_PYTHON="$PWD/.venv-hf/bin/python"
bash .ci/recipes-venv
[ -x .venv-recipes/bin/python ] && [ -f .venv-recipes/.installed ] && export TSUP_RECIPES_PYTHON="$PWD/.venv-recipes/bin/python"
echo "test: ruff"
.venv/bin/ruff check supervisor tests
echo "test: pytest"
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
# pytest exits 5 when it collected nothing: here that means the suite is broken, not "all good".
[ "$rc" -ne 5 ] || echo "tests/run.sh: pytest collected no tests (exit 5)" >&2
exit "$rc"
