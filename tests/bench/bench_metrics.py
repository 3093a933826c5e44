"""CPU cost of the metrics duty per poll at 8 GPUs: what `[metrics]` adds to the daemon.

Not collected by pytest (bench_*.py). Run from the repository root:

    python tests/bench/bench_metrics.py [--polls 2000]

Three figures, CPU time per poll (resource.getrusage, user + system, all threads):
1. exposition: the pure status dict -> Prometheus text, for a status with 8 GPUs;
2. exposition + atomic textfile write (temp file, chmod, rename);
3. the whole duty as the daemon runs it: Daemon.status() (training, 8 GPUs through the real pynvml
   and the fake libnvidia-ml, sync, idle, alerts, cost) + exposition + textfile write.
Then: "% of one core" at the default poll interval (gpu.poll_interval, 5 s).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from supervisor.config import from_dict  # noqa: E402
from supervisor.fleet.metrics import exposition, write_textfile  # noqa: E402
from tests.fixtures.nvml import GIB, FakeNvml, FakeNvmlBuild, _compile, reset_pynvml  # noqa: E402

POLL_S = 5.0


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_poll(fn, n: int) -> float:
    fn()
    t0 = cpu()
    for _ in range(n):
        fn()
    return (cpu() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--polls", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="200 polls a figure")
    ap.add_argument("--rounds", type=int, default=1, help="measure this many times; each round and the median")
    a = ap.parse_args()
    if a.quick:
        a.polls = 200
    tmp = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    lib = tmp / "lib" / "libnvidia-ml.so.1"
    _compile(lib)
    script = tmp / "nvml-script.txt"
    os.environ["FAKE_NVML_SCRIPT"] = str(script)
    fake = FakeNvml(FakeNvmlBuild(str(lib), str(lib)), script)
    fake.write([{"name": "NVIDIA H100 80GB HBM3", "util": 90 + i, "used": 70 * GIB,
                 "procs": [(os.getpid(), 60 * GIB)]} for i in range(8)])
    reset_pynvml()

    from supervisor.daemon.main import Daemon

    textfile = tmp / "prom" / "train_supervisor.prom"
    textfile.parent.mkdir()
    cfg = from_dict({"state_dir": str(tmp / "state"), "socket": str(tmp / "run" / "c.sock"),
                     "price_per_hour": 3.9, "currency": "EUR",
                     "training": {"command": "sleep 1", "workdir": str(tmp), "log": str(tmp / "train.log")},
                     "gpu": {"nvml_library": str(lib)}, "stop": {"action": "dry-run"},
                     "metrics": {"textfile": str(textfile)}})
    d = Daemon(cfg)
    d.gpu.poll()
    st = d.status()
    assert len(st["gpus"]) == 8, st.get("gpu_error")
    text = exposition(st)
    n = a.polls
    names = ("exposition", "exposition + textfile write", "Daemon.status() alone",
             "whole duty: status() + exposition + write")
    figs = [lambda: exposition(st), lambda: write_textfile(str(textfile), exposition(st)), d.status, d.metrics.poll]
    counts = [n, n, max(n // 4, 50), max(n // 4, 50)]
    got: dict[str, list[float]] = {k: [] for k in names}
    print(f"8 GPUs, {len(text.splitlines())} lines / {len(text)} bytes of exposition text")
    for rnd in range(a.rounds):
        k = rnd % len(names)  # rotate which figure runs first
        for name, fn, cnt in list(zip(names, figs, counts, strict=True))[k:] + list(zip(names, figs, counts,
                                                                                           strict=True))[:k]:
            got[name].append(per_poll(fn, cnt))
        if a.rounds > 1:
            print(f"round {rnd + 1}: " + "; ".join(f"{nm} {got[nm][-1] * 1e3:.3f} ms" for nm in names))
    for name in names:
        v = statistics.median(got[name])
        print(f"  {name:<44} {v * 1e3:7.3f} ms CPU per poll = {v / POLL_S * 100:.4f}% of one core at 1 poll/{POLL_S:g}s"
              + (f" (median of {a.rounds})" if a.rounds > 1 else ""))
    d.gpu.close()



if __name__ == "__main__":
    main()
