"""Benchmark: `supervisorctl status` from a fresh process (what an owner's SSH check or a fleet script
pays), ours against supervisord's own `supervisorctl status`, each asking its running daemon, in one
run. Both daemons run at once (bench_daemon_idle's setup: ours with 8 fake GPUs and a sleeping job,
supervisord with one sleeping program); each round runs every command once, the order rotated.

    python tests/bench/bench_status.py [--rounds 15]

Printed: each command's median wall time and peak RSS, and our ratio to supervisord's (< 1: faster).
Ours is timed three ways: `supervisorctl status` (the text), `status --json`, and the entry point
as a console script would be run without the editable install's import hook (`python -m`)."""

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

from tests.bench.bench_daemon_idle import start_ours, start_supervisord, stop_ours, supervisord_path  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


def timed(argv: list[str], env: dict, cwd: Path) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=cwd)
    dt = time.perf_counter() - t
    if r.returncode not in (0, 3):  # 3: ours when the training is not RUNNING
        raise RuntimeError(f"{argv}: {r.returncode} {r.stderr[-500:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    args = ap.parse_args()
    rounds = 5 if args.quick else args.rounds
    if not shutil.which("gcc") or not shutil.which("tmux"):
        print("needs gcc (the fake NVML) and tmux")
        return 0
    home = supervisord_path()
    tmp = Path(tempfile.mkdtemp(prefix="bench-status-"))
    ours = start_ours(tmp, 8, 1.0)
    theirs = start_supervisord(tmp, home) if home else None
    sock = tmp / "ours" / "ctl.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    senv = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if home:
        senv["PYTHONPATH"] = str(home)
    cmds = {
        "ours": [str(Path(sys.executable).parent / "supervisorctl"), "--socket", str(sock), "status"],
        "ours-json": [str(Path(sys.executable).parent / "supervisorctl"), "--socket", str(sock), "status", "--json"],
        "ours-m": [sys.executable, "-m", "supervisor.cli.main", "--socket", str(sock), "status"],
    }
    if home:
        cmds["supervisord"] = [sys.executable, "-c", "from supervisor.supervisorctl import main; main()", "-c",
                               str(tmp / "supervisord" / "supervisord.conf"), "status"]
    try:
        wait_until(sock.exists, 60, what="our daemon's socket")
        if home:
            wait_until((tmp / "supervisord" / "supervisor.sock").exists, 60, what="supervisord's socket")
        time.sleep(3)  # both past their start-up work
        names = list(cmds)
        times: dict[str, list[float]] = {n: [] for n in names}
        rss: dict[str, float] = {}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                dt = timed(cmds[n], senv if n == "supervisord" else env, tmp)  # not this checkout's `supervisor`
                times[n].append(dt)
        for n in names:  # peak RSS of each on its own: GNU time (a forked child's rusage counts the parent's pages)
            gnu = shutil.which("time") or "/usr/bin/time"
            if not os.path.exists(gnu):
                rss[n] = float("nan")  # no GNU time (apt install time): no RSS figure
                continue
            r = subprocess.run([gnu, "-f", "%M", *cmds[n]], env=senv if n == "supervisord" else env,
                               capture_output=True, text=True, cwd=tmp)
            last = r.stderr.strip().splitlines()[-1:] or ["0"]
            rss[n] = int(last[0]) / 1024 if last[0].isdigit() else float("nan")
        med = {n: statistics.median(t) for n, t in times.items() if t}
        print(f"== supervisorctl status, {rounds} rounds (median wall, peak RSS)")
        for n, m in sorted(med.items(), key=lambda kv: kv[1]):
            ratio = f"  ours/this = {med['ours'] / m:.2f}" if n != "ours" else ""
            print(f"  {n:<12} {m * 1000:6.0f} ms  {rss[n]:5.1f} MiB{ratio}")
    finally:
        stop_ours(tmp, ours)
        if theirs:
            theirs.terminate()
            theirs.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
