"""The daemon's own cost at rest, beside supervisord doing the same job over the same window.

Ours: a real train-supervisord with 8 fake GPUs (the C fake libnvidia-ml of tests/fake_nvml)
polled every second, a watched output folder synced to a local target, idle protection on, and a
training job that sleeps in tmux. Beside it, at the same time: supervisord (the pip `supervisor`
package, in a private folder so its `supervisor` module never meets ours) running the same
sleeping job. After a warm-up both are measured over the same window: CPU % of one core (the
process and the children it waited for), RSS at the end and its peak, context switches per second
(wakeups). Rounds rotate which starts first; each prints its ratios, then the medians.

    python tests/bench/bench_daemon_idle.py [--quick] [--rounds 3] [--seconds 120] [--gpus 8] [--poll 1] [--sources]

Goals (issue 16): at most 0.2 % of one core and 40 MiB RSS for ours. With --sources (issue 40) the
training writes four progress sources once a second (a TSUP log line, a TensorBoard event, an MLflow
metric line, trainer_state.json) and the daemon reads them all: the same goal holds.
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

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures.daemon import to_toml  # noqa: E402
from tests.fixtures.procs import kill_under  # noqa: E402

MiB = 2**20
SUPERVISORD_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "train-supervisor-bench" / "supervisord"


def supervisord_path() -> Path | None:
    """A folder holding the pip `supervisor` package, installed there once (pip --target): in the
    project's venv its module would shadow ours, both being named `supervisor`."""
    if (SUPERVISORD_HOME / "supervisor" / "supervisord.py").exists():
        return SUPERVISORD_HOME
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(SUPERVISORD_HOME),
                        "supervisor"], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"supervisord not installable here (pip: {r.stderr.strip()[-300:]}); measuring ours alone")
        return None
    return SUPERVISORD_HOME


class Sample:
    def __init__(self, proc: psutil.Process):
        self.p = proc
        self.c0 = self._cpu()
        self.s0 = self._switches()
        self.t0 = time.monotonic()
        self.peak = proc.memory_info().rss

    def _cpu(self) -> float:
        t = self.p.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def _switches(self) -> int:
        """Context switches of every thread (a wakeup of any of them counts)."""
        n = 0
        for task in Path(f"/proc/{self.p.pid}/task").glob("*"):
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.endswith("ctxt_switches:") or "ctxt_switches:" in line:
                        n += int(line.split()[-1])
            except (OSError, ValueError):
                continue
        return n

    def tick(self) -> None:
        self.peak = max(self.peak, self.p.memory_info().rss)

    def end(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        rss = self.p.memory_info().rss
        return {"cpu%": 100 * (self._cpu() - self.c0) / wall, "rss": rss / MiB, "peak": max(self.peak, rss) / MiB,
                "uss": self.p.memory_full_info().uss / MiB, "wakeups/s": (self._switches() - self.s0) / wall,
                "threads": self.p.num_threads()}


WRITER = """
import json, os, struct, sys, time
sys.path.insert(0, {repo!r})
from tests.progress.test_progress_sources import event, record
out = {out!r}
os.makedirs(out + "/runs/a", exist_ok=True)
os.makedirs(out + "/mlruns/0/r1/metrics/train", exist_ok=True)
open(out + "/mlruns/0/r1/meta.yaml", "w").write("status: 1\\n")
step = 0
while True:
    step += 1
    t = time.time()
    print("TSUP " + json.dumps({{"step": step, "max_steps": 100000, "time": t}}), flush=True)
    with open(out + "/runs/a/events.out.tfevents.1.bench", "ab") as f:
        f.write(record(event(step, t, "train/loss", 1.0 / step)))
    with open(out + "/mlruns/0/r1/metrics/train/loss", "a") as f:
        f.write("%d %f %d\\n" % (t * 1000, 1.0 / step, step))
    with open(out + "/trainer_state.json.tmp", "w") as f:
        json.dump({{"global_step": step, "max_steps": 100000, "log_history": []}}, f)
    os.replace(out + "/trainer_state.json.tmp", out + "/trainer_state.json")
    time.sleep(1.0)
"""


def start_ours(tmp: Path, gpus: int, poll: float, sources: bool = False) -> subprocess.Popen:
    lib = tmp / "libnvidia-ml.so.1"
    if not lib.exists():
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(lib),
                        str(REPO / "tests" / "fake_nvml" / "fake_nvml.c")], check=True)
    script = tmp / "nvml.txt"
    script.write_text("\n".join([f"count={gpus}"] + [f"gpu.{i}.util=0" for i in range(gpus)]) + "\n")
    d = tmp / "ours"
    shutil.rmtree(d, ignore_errors=True)
    (d / "out").mkdir(parents=True)
    (d / "remote").mkdir()
    command = "sleep 100000"
    if sources:
        (d / "writer.py").write_text(WRITER.format(repo=str(REPO), out=str(d / "out")))
        command = f"{sys.executable} {d / 'writer.py'}"
    cfg = {
        "state_dir": str(d / "state"), "socket": str(d / "ctl.sock"),
        "training": {"command": command, "workdir": str(d), "log": str(d / "train.log"),
                     "autostart": True, "on_finish": "none"},
        "gpu": {"nvml_library": str(lib), "poll_interval": f"{poll}s"},
        "sync": {"target": str(d / "remote"), "watch": [str(d / "out")]},
        "stop": {"action": "dry-run"},
    }
    (d / "config.toml").write_text(to_toml(cfg))
    env = {**os.environ, "FAKE_NVML_SCRIPT": str(script), "TRAIN_SUPERVISOR_NO_SCOPE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "supervisor.daemon.main", "--config", str(d / "config.toml")],
                            stdout=open(d / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env, cwd=str(d),
                            start_new_session=True)


def stop_ours(tmp: Path, p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
    # a daemon that stops leaves the training running (by design): end it and its tmux here
    kill_under(tmp / "ours", settle=0.2)


def start_supervisord(tmp: Path, home: Path) -> subprocess.Popen:
    d = tmp / "supervisord"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    (d / "supervisord.conf").write_text(f"""\
[supervisord]
nodaemon=true
logfile={d}/supervisord.log
pidfile={d}/supervisord.pid
childlogdir={d}

[unix_http_server]
file={d}/supervisor.sock

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{d}/supervisor.sock

[program:train]
command=sleep 100000
autostart=true
stdout_logfile={d}/train.log
redirect_stderr=true
""")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(home)
    return subprocess.Popen([sys.executable, "-c", "from supervisor.supervisord import main; main()",
                             "-c", str(d / "supervisord.conf")], env=env, cwd=str(d),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of a 60 s window")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1)")
    ap.add_argument("--seconds", type=float, default=None, help="measured window per round (default 120, --quick 60)")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring (imports, first scan)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--poll", type=float, default=1.0, help="GPU poll interval in seconds")
    ap.add_argument("--sources", action="store_true", help="the training writes four progress sources a second")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (60.0 if args.quick else 120.0)
    if not shutil.which("gcc") or not shutil.which("tmux"):
        print("gcc and tmux are needed (the fake NVML library, the training session): skipped")
        return 0
    home = supervisord_path()
    tmp = Path(tempfile.mkdtemp(prefix="tsup-idle-"))
    names = ["ours", "supervisord"] if home else ["ours"]
    res: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    print(f"{args.gpus} fake GPUs polled every {args.poll:g} s; {rounds} round(s) of {seconds:.0f} s after "
          f"{args.warmup:.0f} s warm-up; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    try:
        for rnd in range(rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            procs: dict[str, subprocess.Popen] = {}
            try:
                for n in order:
                    procs[n] = (start_ours(tmp, args.gpus, args.poll, args.sources) if n == "ours"
                                else start_supervisord(tmp, home))
                time.sleep(args.warmup)
                for n, p in procs.items():
                    if p.poll() is not None:
                        raise RuntimeError(f"{n} exited {p.returncode} (logs in {tmp})")
                samples = {n: Sample(psutil.Process(p.pid)) for n, p in procs.items()}
                t0 = time.monotonic()
                while time.monotonic() - t0 < seconds:
                    time.sleep(min(5.0, max(0.1, seconds - (time.monotonic() - t0))))
                    for s in samples.values():
                        s.tick()
                got = {n: s.end() for n, s in samples.items()}
            finally:
                for n, p in procs.items():
                    stop_ours(tmp, p) if n == "ours" else (p.terminate(), p.wait(20))
            for n in names:
                res[n].append(got[n])
            line = "  ".join(f"{n} CPU {g['cpu%']:.3f}% RSS {g['rss']:.1f} MiB ({g['wakeups/s']:.1f} wakeups/s)"
                             for n, g in got.items())
            if "supervisord" in got:
                line += (f"  ratio CPU {got['ours']['cpu%'] / max(got['supervisord']['cpu%'], 1e-3):.1f}x"
                         f" RSS {got['ours']['rss'] / got['supervisord']['rss']:.2f}x")
            print(f"round {rnd + 1} ({'/'.join(order)}): {line}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in res.items()}
    print(f"\nmedian of {rounds} round(s) over {seconds:.0f} s:")
    for n, m in med.items():
        print(f"  {n:12s} CPU {m['cpu%']:.3f}% of one core  RSS {m['rss']:.1f} MiB (peak {m['peak']:.1f}, "
              f"USS {m['uss']:.1f})  {m['wakeups/s']:.1f} wakeups/s  {m['threads']:.0f} threads")
    o = med["ours"]
    print(f"goals: CPU {o['cpu%']:.3f}% <= 0.2%: {'met' if o['cpu%'] <= 0.2 else 'NOT met'}; "
          f"RSS {o['rss']:.1f} MiB <= 40 MiB: {'met' if o['rss'] <= 40 else 'NOT met'}")
    if "supervisord" in med:
        ratios = [a["cpu%"] / max(b["cpu%"], 1e-3) for a, b in zip(res["ours"], res["supervisord"], strict=True)]
        rss = [a["rss"] / b["rss"] for a, b in zip(res["ours"], res["supervisord"], strict=True)]
        print(f"ours / supervisord, median of per-round ratios: CPU {statistics.median(ratios):.1f}x, "
              f"RSS {statistics.median(rss):.2f}x")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
