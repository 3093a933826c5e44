"""Benchmark: our restore (`python -m supervisor.resume`: list, read the manifests, download, verify
every file's sha256, record in the ledger) against `s5cmd cp`, `rclone copy` and `aws s3 cp
--recursive` of the same folder from the same local SeaweedFS, on two trees:

- `checkpoint`: one synthetic checkpoint of about 2 GiB (bench_sync.make_checkpoint);
- `lora`: the newest folder of a LoRA run (bench_sync.make_lora_run: 20 checkpoints of ~50 MiB; the
  restore lists and judges all 20 and downloads the newest).

    python tests/bench/bench_restore.py [--tree checkpoint|lora|both] [--quick] [--rounds 3]

`s5verify` is `s5cmd cp` followed by sha256sum of every file (two at a time): the peers copy
unchecked, ours checks every byte against the manifest, and this row prices that check.

`daemon` is the same restore the way the daemon runs it before a training starts: in a process
already running (the imports done), a target and a Restorer made for the restore and closed after
(resume/gate.py `_with`). The `ours` row adds Python's start-up and imports (~70 ms) to it.

The trees go up once with our sync (`python -m supervisor.sync --once`). Each round every tool
downloads into an empty folder as a fresh process (start-up counts for everyone), the order rotated;
the result is checked (file count and bytes), then removed. Dirty pages are written out before
each run (os.sync, untimed): ours fsyncs the restored folder, and ext4's journal would otherwise
make it wait for the writeback of the 2 GiB the tool before it left dirty. Then the disk settles
for SETTLE_S (untimed): ours is the only tool that fsyncs, and on this VM an fsync just after the
previous tool's folder was removed and synced took 21-23 ms, a second later 1-11 ms (the root is
ext4 mounted with `discard`: the trim of the freed blocks is the likely cause). Prints each round
and the medians, and our time relative to each peer. Peers come from the bench extra (`pip install -e .[bench]`); a
missing one is reported and skipped. `--quick`: 256 MiB checkpoint, 20 x 12 MiB LoRA run.
`--rtt MS`: the restores (not the upload) reach the store through latency_proxy.py, which adds a
round trip to every connection and request, as S3 in the same region has and loopback has not.
The Hub target (`lora` tree against `hf download`): tests/bench/bench_restore_hf.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.bench_sync import Bench, MiB, make_checkpoint, make_lora_run, run, tool  # noqa: E402
from tests.bench.latency_proxy import LatencyProxy  # noqa: E402
from tests.fixtures.s3 import SeaweedS3  # noqa: E402
from tests.fixtures.sync_engine import to_toml  # noqa: E402

SETTLE_S = 1.0


class Restore(Bench):
    read_endpoint = ""  # where the restores read (a LatencyProxy with --rtt); the upload goes direct

    @property
    def ep(self) -> str:
        return self.read_endpoint or self.s3.endpoint

    def rclone(self, prefix: str) -> list[str] | None:
        argv = super().rclone(prefix)
        self.env["RCLONE_CONFIG_BENCH_ENDPOINT"] = self.ep
        return argv

    def upload(self, prefix: str) -> None:
        run(self.ours(prefix), self.env)

    def ours_restore(self, prefix: str, dest: Path) -> list[str]:
        d = self.work / f"restore-{prefix}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        cfg = {"state_dir": str(d / "state"), "log_level": "warning",
               "sync": {"target": f"s3://{self.s3.bucket}/{prefix}", "endpoint_url": self.ep,
                        "region": "us-east-1", "watch": [str(dest)]}}
        (d / "cfg.toml").write_text(to_toml(cfg))
        return [sys.executable, "-m", "supervisor.resume", "--config", str(d / "cfg.toml")]

    def s5cmd_cp(self, prefix: str, unit: str, dest: Path) -> list[str] | None:
        exe = tool("s5cmd")
        return exe and [exe, "--endpoint-url", self.ep, "cp", f"s3://{self.s3.bucket}/{prefix}/{unit}/*",
                        f"{dest / unit}/"]

    def rclone_copy(self, prefix: str, unit: str, dest: Path) -> list[str] | None:
        if not self.rclone(prefix):
            return None
        return [tool("rclone") or "rclone", "copy", f"bench:{self.s3.bucket}/{prefix}/{unit}", str(dest / unit)]

    def s5verify_cp(self, prefix: str, unit: str, dest: Path) -> list[str] | None:
        """s5cmd cp, then every file hashed with sha256sum on both cores: what a user runs to know
        the copy matches its manifest (ours always checks every byte; the plain peers do not)."""
        cp = self.s5cmd_cp(prefix, unit, dest)
        if not cp or not shutil.which("sha256sum"):
            return None
        return ["bash", "-c", " ".join(map(shlex.quote, cp)) + f" >/dev/null && find {shlex.quote(str(dest / unit))} "
                "-type f ! -name _MANIFEST.json -print0 | xargs -0 -P 2 -n 8 sha256sum >/dev/null"]

    def aws_cp(self, prefix: str, unit: str, dest: Path) -> list[str] | None:
        exe = tool("aws")
        return exe and [exe, "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url", self.ep,
                        f"s3://{self.s3.bucket}/{prefix}/{unit}/", f"{dest / unit}/"]


WORKER = r"""
import json, sys, time
from supervisor.config import load
from supervisor.resume.restore import Restorer
from supervisor.sync.ledger import Ledger
from supervisor.sync.scan import watch_roots
from supervisor.store import make_target, target_identity
from supervisor.store import _log
from supervisor.config.target import parse_target
for line in sys.stdin:
    t = time.perf_counter()
    cfg = load(line.strip())
    _log.min_level = _log.LEVELS.get(str(cfg.log_level).lower(), 0)
    url = parse_target(cfg.sync.target)
    target = make_target(url, cfg.sync, cfg.state_dir)
    ledger = Ledger(cfg.state_dir, target_identity(url, cfg.sync))
    try:
        res = Restorer(target, ledger, watch_roots(cfg.sync.watch), time.time).restore()
    finally:
        ledger.close()
        target.close()
    print("@@" + json.dumps({"s": time.perf_counter() - t, "unit": res.unit.key}), flush=True)
"""


class DaemonLike:
    """A process that stays up between rounds and restores on request, as the daemon does."""

    def __init__(self, env: dict):
        self.p = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def restore(self, cfg: str) -> float:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(cfg + "\n")
        self.p.stdin.flush()
        while line := self.p.stdout.readline():
            if line.startswith("@@"):
                return float(json.loads(line[2:])["s"])
        raise RuntimeError(f"daemon-like restore failed ({self.p.wait()})")

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(30)


def tree_size(p: Path) -> tuple[int, int]:
    files = [f for f in p.rglob("*") if f.is_file() and f.name != "_MANIFEST.json"]
    return len(files), sum(f.stat().st_size for f in files)


def bench_tree(b: Restore, prefix: str, unit: str, want: tuple[int, int], rounds: int) -> dict[str, list[float]]:
    names = ["ours", "daemon", "s5cmd", "rclone", "aws", "s5verify"]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    daemon = DaemonLike(b.env)
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            line = []
            for n in order:
                dest = b.work / f"dest-{n}"
                if dest.exists():
                    shutil.rmtree(dest)
                dest.mkdir()
                os.sync()  # no tool's timing pays for the writeback of the one before (ours fsyncs its folder)
                time.sleep(SETTLE_S)  # ...nor for the trim of the blocks the last rmtree freed (see the doc)
                if n == "daemon":
                    argv = b.ours_restore(prefix, dest)
                    dt = daemon.restore(argv[-1])
                else:
                    argv = b.ours_restore(prefix, dest) if n == "ours" else getattr(
                        b, f"{n}_{'cp' if n != 'rclone' else 'copy'}")(prefix, unit, dest)
                    if not argv:
                        if r == 0:
                            print(f"  {n}: not installed, skipped")
                        continue
                    dt, cpu = run(argv, b.env)
                    cpus[n].append(cpu)
                got = tree_size(dest / unit)
                if got != want:
                    raise RuntimeError(f"{n}: restored {got}, expected {want}")
                times[n].append(dt)
                line.append(f"{n} {dt:.2f}s" + (f" (cpu {cpus[n][-1]:.2f}s)" if n != "daemon" else ""))
                shutil.rmtree(dest)
            print(f"  round {r + 1}: " + ", ".join(line), flush=True)
    finally:
        daemon.close()
    return {n: t for n, t in times.items() if t}


def report(tree: str, nbytes: int, times: dict[str, list[float]]) -> None:
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"== {tree}: medians ({nbytes / MiB:.0f} MiB)")
    for n, m in sorted(med.items(), key=lambda kv: kv[1]):
        rel = "".join(f"  {o}/{n} = {med[o] / m:.2f}" for o in ("ours", "daemon") if n not in ("ours", "daemon")
                      and o in med)
        print(f"  {n:<8} {m:7.2f}s  {nbytes / MiB / m:8.1f} MiB/s{rel}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", choices=["checkpoint", "lora", "both"], default="both")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rtt", type=float, default=0.0, metavar="MS",
                    help="every restore's requests through a proxy adding this round trip (latency_proxy.py)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-restore-"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   capture_output=True)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    stack = contextlib.ExitStack()
    if args.rtt:
        print(f"every restore's requests wait a {args.rtt:g} ms round trip (latency_proxy.py)")
    try:
        for tree in (["checkpoint", "lora"] if args.tree == "both" else [args.tree]):
            src = base / f"src-{tree}"
            src.mkdir(parents=True)
            if tree == "checkpoint":
                make_checkpoint(src, 256 if args.quick else 2048, 128 if args.quick else 512)
            else:
                make_lora_run(src, 20, 12 if args.quick else 50, 2 if args.quick else 1.8)
            unit = max((p.name for p in src.iterdir()), key=lambda n: int(n.split("-")[1]))
            want = tree_size(src / unit)
            b = Restore(s3, src, base / f"work-{tree}")
            t = time.perf_counter()
            b.upload(tree)
            if args.rtt:
                host, port = s3.endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
                proxy = stack.enter_context(LatencyProxy(host, int(port), args.rtt / 1000))
                b.read_endpoint = proxy.endpoint
            print(f"\n== {tree}: {unit}, {want[0]} files, {want[1] / MiB:.0f} MiB "
                  f"(uploaded in {time.perf_counter() - t:.1f}s)", flush=True)
            shutil.rmtree(src)  # the restore must not find it locally
            report(tree, want[1], bench_tree(b, tree, unit, want, args.rounds))
    finally:
        stack.close()
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
