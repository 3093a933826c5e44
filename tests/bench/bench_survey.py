"""Benchmark: the restore's survey (list the target, read every unit's _MANIFEST.json and
trainer_state.json, judge) against the number of checkpoints on a SeaweedFS target, and against
`s5cmd ls` of the same prefix (what a user's script would do first). No keep_last: a run that saves
every 100 steps for 20,000 steps leaves 200 checkpoints on the target, and a resume reads them all
before its first byte of the newest.

    python tests/bench/bench_survey.py [--units 20,200] [--rounds 5] [--quick]

`--quick` (tests/bench/run.sh's default): 20 and 100 units, 3 rounds. Each count twice: manifests
that carry their unit's step (as the sync writes them since 2026-12-06: one GET per unit), and
manifests without it (written before: trainer_state.json read too).

The units are tiny (the survey reads manifests, not the files): put on the target directly with
their manifests, as our sync writes them. In one process, so the figure is the survey alone
(the one-shot command adds Python's start-up, see bench_restore.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from supervisor.config import from_dict  # noqa: E402
from supervisor.config.target import parse_target  # noqa: E402
from supervisor.resume.restore import Restorer  # noqa: E402
from supervisor.store import make_target  # noqa: E402
from supervisor.sync.manifest import ManifestFile, build  # noqa: E402
from supervisor.sync.scan import watch_roots  # noqa: E402
from tests.bench.bench_sync import tool  # noqa: E402
from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402


def put_units(s3: SeaweedS3, prefix: str, n: int, with_step: bool = True) -> None:
    c = s3.client()
    for step in range(1, n + 1):
        files = {"adapter_model.safetensors": os.urandom(1024),
                 "adapter_config.json": b'{"peft_type": "LORA"}',
                 "trainer_state.json": f'{{"global_step": {step * 100}, "max_steps": {n * 100}}}'.encode()}
        unit = f"checkpoint-{step * 100}"
        for name, data in files.items():
            c.put_object(Bucket=s3.bucket, Key=f"{prefix}/{unit}/{name}", Body=data)
        mfs = [ManifestFile(k, len(v), hashlib.sha256(v).hexdigest()) for k, v in files.items()]
        c.put_object(Bucket=s3.bucket, Key=f"{prefix}/{unit}/_MANIFEST.json", Body=build(unit, mfs, time.time(),
                                                                                    trainer=(step * 100, n * 100) if with_step else None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", default="20,200")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.units, args.rounds = "20,100", min(args.rounds, 3)
    base = Path(tempfile.mkdtemp(prefix="bench-survey-"))
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    s5cmd = tool("s5cmd")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_REGION": "us-east-1"}
    try:
        for n, with_step in ((int(x), w) for x in args.units.split(",") for w in (True, False)):
            prefix = f"run{n}{'' if with_step else '-older'}"
            put_units(s3, prefix, n, with_step)
            cfg = from_dict({"state_dir": str(base / "state"), "log_level": "warning",
                             "sync": {**s3.sync_config(prefix), "watch": [str(base / "out")]}})
            ours, peer = [], []
            for _ in range(args.rounds):
                target = make_target(parse_target(cfg.sync.target), cfg.sync, cfg.state_dir)
                rs = Restorer(target, None, watch_roots(cfg.sync.watch), time.time)
                t = time.perf_counter()
                sv = rs.survey()
                ours.append(time.perf_counter() - t)
                assert len(sv.units) == n and sv.order[0].step == n * 100
                target.close()
                if s5cmd:
                    t = time.perf_counter()
                    subprocess.run([s5cmd, "--endpoint-url", s3.endpoint, "ls", f"s3://{s3.bucket}/{prefix}/*"],
                                   env=env,
                                   check=True, capture_output=True)
                    peer.append(time.perf_counter() - t)
            line = f"{n:4} units{'' if with_step else ', manifests without the step'}: survey {statistics.median(ours):.3f}s ({statistics.median(ours) / n * 1000:.1f} ms a unit)"
            if peer:
                line += f", s5cmd ls {statistics.median(peer):.3f}s, ratio {statistics.median(ours) / statistics.median(peer):.2f}"
            print(line, flush=True)
    finally:
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
