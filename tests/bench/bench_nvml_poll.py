"""CPU cost of GPU polling: GpuMonitor.poll over the real pynvml and the fake libnvidia-ml with 8 GPUs.

Not collected by pytest (bench_*.py). Run from the repository root:

    /tmp/venv/bin/python tests/bench/bench_nvml_poll.py            # all three measurements
    /tmp/venv/bin/python tests/bench/bench_nvml_poll.py --seconds 60
    python tests/bench/bench_nvml_poll.py --real --seconds 10   # on a GPU machine, its real driver

1. tight: N polls back to back, CPU time per poll, scaled to one poll a second;
2. realtime: a poll every second for --seconds, CPU time of the whole process over wall time
   (includes the interpreter waking up, the sleeping loop, everything);
3. scheduler: the same through APScheduler's BackgroundScheduler, as the daemon runs it.

CPU time is resource.getrusage(RUSAGE_SELF) (all threads, user + system); "% of one core" is
CPU seconds per wall second x 100. The fake re-reads nothing between polls (the script file is
unchanged), so the figure is the probe's own cost plus the binding's ctypes calls.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from supervisor.cli.render import gpu_lines  # noqa: E402
from supervisor.clock import SystemClock  # noqa: E402
from supervisor.gpu.monitor import GpuMonitor  # noqa: E402
from tests.fixtures.nvml import GIB, FakeNvml, FakeNvmlBuild, _compile, make_ctx, reset_pynvml  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Training:
    def info(self):  # pragma: no cover
        raise NotImplementedError

    def pids(self) -> set[int]:
        return {os.getpid()}


def setup_real(tmp: Path) -> GpuMonitor:
    """The machine's own driver (on a GPU box): the same figures, plus what the real library does."""
    ctx = make_ctx(tmp, SystemClock(), {"gpu": {"poll_interval": "1s"}})
    m = GpuMonitor(ctx, ctx.config.gpu, training=Training())
    t0 = time.perf_counter()
    snap = m.poll()
    print(f"real driver {snap.driver_version}: {len(snap.gpus)} GPU(s), error={snap.error!r}, "
          f"first poll (with init) {1e3 * (time.perf_counter() - t0):.1f} ms")
    for line in gpu_lines(m.status()):
        print("  " + line)
    st = m.probe._state
    if st is not None and st.event_set is not None:
        import pynvml

        t0 = time.perf_counter()
        try:
            pynvml.nvmlEventSetWait(st.event_set, 0)
        except pynvml.NVMLError as e:
            print(f"  event wait(0 ms): {type(e).__name__}")
        print(f"  event wait(0 ms) took {1e3 * (time.perf_counter() - t0):.2f} ms (must not block)")
    else:
        print("  no Xid event set registered")
    return m


def setup(tmp: Path) -> GpuMonitor:
    lib = tmp / "lib" / "libnvidia-ml.so.1"
    _compile(lib)
    script = tmp / "script.txt"
    os.environ["FAKE_NVML_SCRIPT"] = str(script)
    fake = FakeNvml(FakeNvmlBuild(str(lib), str(lib)), script)
    me = os.getpid()
    fake.write([{"util": 90 + i % 10, "used": (60 + i) * GIB, "total": 80 * GIB,
                 "procs": [(me, (60 + i) * GIB), (100000 + i, GIB)]} for i in range(8)])
    reset_pynvml()
    ctx = make_ctx(tmp, SystemClock(), {"gpu": {"poll_interval": "1s", "nvml_library": str(lib)}})
    m = GpuMonitor(ctx, ctx.config.gpu, training=Training())
    snap = m.poll()
    assert len(snap.gpus) == 8 and snap.error is None, snap
    return m


def tight(m: GpuMonitor, n: int) -> float:
    for _ in range(50):
        m.poll()
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(n):
        m.poll()
    per_poll = (cpu() - c0) / n
    wall = (time.perf_counter() - t0) / n
    print(f"tight:     {n} polls, {per_poll * 1e6:.0f} us CPU per poll ({wall * 1e6:.0f} us wall) "
          f"-> {per_poll * 100:.3f}% of one core at 1 poll/s")
    return per_poll * 100


def realtime(m: GpuMonitor, seconds: int) -> float:
    c0, t0 = cpu(), time.monotonic()
    nxt = t0
    polls = 0
    while time.monotonic() - t0 < seconds:
        m.poll()
        polls += 1
        nxt += 1.0
        time.sleep(max(0.0, nxt - time.monotonic()))
    pct = (cpu() - c0) / (time.monotonic() - t0) * 100
    print(f"realtime:  {polls} polls over {seconds}s -> {pct:.3f}% of one core (whole process)")
    return pct


def scheduler(m: GpuMonitor, seconds: int) -> float:
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.schedulers.background import BackgroundScheduler

    s = BackgroundScheduler(executors={"default": ThreadPoolExecutor(8)},
                            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60})
    s.add_job(m.poll, "interval", seconds=1.0)
    s.start()
    c0, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    pct = (cpu() - c0) / (time.monotonic() - t0) * 100
    s.shutdown(wait=True)
    print(f"scheduler: APScheduler job every 1s for {seconds}s -> {pct:.3f}% of one core (whole process)")
    return pct


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--polls", type=int, default=2000)
    ap.add_argument("--real", action="store_true", help="use this machine's NVIDIA driver, not the fake")
    ap.add_argument("--quick", action="store_true", help="5 s windows, 500 polls")
    ap.add_argument("--rounds", type=int, default=1, help="measure this many times (order rotated); the median")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.polls = 5, 500
    worsts = []
    with tempfile.TemporaryDirectory() as d:
        m = setup_real(Path(d)) if args.real else setup(Path(d))
        try:
            for rnd in range(args.rounds):
                figs = [lambda: tight(m, args.polls), lambda: realtime(m, args.seconds),
                        lambda: scheduler(m, args.seconds)]
                k = rnd % len(figs)
                results = [f() for f in figs[k:] + figs[:k]]
                worsts.append(max(results))
                if args.rounds > 1:
                    print(f"round {rnd + 1}: worst {worsts[-1]:.3f}% of one core")
        finally:
            m.close()
    worst = statistics.median(worsts)
    print(f"worst: {worst:.3f}% of one core for {len(m.status()['gpus'])} GPU(s) polled every second "
          f"({'well under' if worst < 0.5 else 'NOT under'} 1%)")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
