"""The kill -9 resume tally: the S3 engine killed three times mid-upload, N runs of each variant.

Not a timing: it counts. Each run is tests/store/test_sync_s3.py's
test_kill9_mid_upload_resumes_and_sends_nothing_twice (a real SeaweedFS, the sync engine as a
child process killed with SIGKILL in a multipart upload, between files and among the small files;
nothing the store held at a kill may be sent again, nothing may be missing or done twice), once
per variant: 2x5M (the original settings), 16x8M (the parallel multipart path), 16x64M-put (the
default for files this size: each one streamed in a single PUT, killed in the middle of one).

    python tests/bench/bench_kill9.py [--rounds 20] [--variant 16x64M-put]

Runs them in one pytest session (pytest-repeat's --count), so SeaweedFS starts once; prints the
tally per variant and the first failure's summary. About 7 s a run on 2 cores: the full tally
(20 x 3) takes 7 minutes; `--quick` (what tests/bench/run.sh passes) is 20 runs of the default
variant only, 16x64M-put.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST = "tests/store/test_sync_s3.py::test_kill9_mid_upload_resumes_and_sends_nothing_twice"
VARIANTS = ["2x5M", "16x8M", "16x64M-put"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20, help="runs of each variant (default 20)")
    ap.add_argument("--variant", action="append", choices=VARIANTS, help="only these (default: all three)")
    ap.add_argument("--quick", action="store_true", help="20 runs of the default variant (16x64M-put) only")
    args = ap.parse_args()
    variants = args.variant or (["16x64M-put"] if args.quick else VARIANTS)
    try:
        import pytest_repeat  # noqa: F401
    except ImportError:
        print("bench_kill9: needs pytest-repeat (pip install -e .[bench])", file=sys.stderr)
        return 2
    sel = " or ".join(v.split("-")[0] for v in variants)  # -k takes no brackets or dashes
    argv = [sys.executable, "-m", "pytest", TEST, "-k", sel, "-m", "slow", f"--count={args.rounds}",
            "--repeat-scope=function", "-p", "no:cacheprovider", "-q", "-rf", "--no-header",
            "-o", "console_output_style=classic"]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.rounds} runs of {', '.join(variants)}", flush=True)
    t = time.perf_counter()
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    took = time.perf_counter() - t
    # -rf lists every failure as "FAILED tests/...::test[<variant>-<i>-<n>] - reason"
    failed = collections.Counter()
    first: dict[str, str] = {}
    for line in r.stdout.splitlines():
        m = re.match(r"FAILED \S+\[(?P<id>[^\]]+)\](?: - (?P<why>.*))?", line)
        if m:
            v = next((x for x in variants if m["id"].startswith(x)), m["id"])
            failed[v] += 1
            first.setdefault(v, (m["why"] or "")[:300])
    m = re.search(r"(\d+) passed", r.stdout)
    passed = int(m.group(1)) if m else 0
    if passed + sum(failed.values()) != args.rounds * len(variants):
        print(r.stdout[-3000:], r.stderr[-2000:], sep="\n")
        print(f"bench_kill9: expected {args.rounds * len(variants)} results, got {passed} passed and "
              f"{sum(failed.values())} failed", file=sys.stderr)
        return 1
    for v in variants:
        ok = args.rounds - failed[v]
        print(f"  kill -9 resume, {v:11s}: {ok}/{args.rounds} runs passed" +
              (f"   first failure: {first[v]}" if v in first else ""))
    print(f"  all variants: {passed}/{args.rounds * len(variants)} in {took:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
