"""The daemon's own cost while it supervises: RSS and CPU over a window (default 5 minutes).

A real train-supervisord with 8 fake GPUs (the C fake libnvidia-ml, polled every 5 s as by default),
a watched output folder synced to a local target, idle protection on, and a training job that
sleeps in tmux. Prints CPU % of one core and RSS; compares with supervisord when it is installed.

    python tests/bench/bench_daemon_idle.py [SECONDS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fixtures.daemon import to_toml  # noqa: E402


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
    tmp = Path(tempfile.mkdtemp(prefix="tsup-bench-"))
    lib = tmp / "libnvidia-ml.so.1"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(lib),
                    str(REPO / "tests" / "fake_nvml" / "fake_nvml.c")], check=True)
    script = tmp / "nvml.txt"
    lines = ["count=8"] + [f"gpu.{i}.util=0" for i in range(8)]
    script.write_text("\n".join(lines) + "\n")
    (tmp / "out").mkdir()
    (tmp / "remote").mkdir()
    cfg = {
        "state_dir": str(tmp / "state"), "socket": str(tmp / "ctl.sock"),
        "training": {"command": "sleep 100000", "workdir": str(tmp), "log": str(tmp / "train.log"),
                     "autostart": True, "on_finish": "none"},
        "gpu": {"nvml_library": str(lib)},
        "sync": {"target": str(tmp / "remote"), "watch": [str(tmp / "out")]},
        "stop": {"action": "dry-run"},
    }
    (tmp / "config.toml").write_text(to_toml(cfg))
    env = {**os.environ, "FAKE_NVML_SCRIPT": str(script), "TRAIN_SUPERVISOR_NO_SCOPE": "1",
           "PYTHONPATH": str(REPO)}
    d = subprocess.Popen([sys.executable, "-m", "supervisor.daemon", "--config", str(tmp / "config.toml")],
                         stdout=open(tmp / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env)
    try:
        p = psutil.Process(d.pid)
        time.sleep(15)  # start-up (imports, first scan) is not the steady state we measure
        c0 = p.cpu_times()
        t0 = time.monotonic()
        peak = 0
        while time.monotonic() - t0 < seconds:
            time.sleep(5)
            peak = max(peak, p.memory_info().rss)
        c1 = p.cpu_times()
        wall = time.monotonic() - t0
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        rss = p.memory_info().rss
        uss = p.memory_full_info().uss
        print(f"train-supervisord over {wall:.0f} s: CPU {cpu:.2f} s = {100 * cpu / wall:.3f}% of one core; "
              f"RSS {rss / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB, USS {uss / 2**20:.1f} MiB); "
              f"threads {p.num_threads()}")
    finally:
        d.terminate()
        d.wait(15)
        subprocess.run(["tmux", "-S", str(tmp / "state" / "tmux.sock"), "kill-server"], capture_output=True)


if __name__ == "__main__":
    main()
