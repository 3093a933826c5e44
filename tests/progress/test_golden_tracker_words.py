"""Golden texts: every mail and status line the progress tracker, the GPU monitor, the OOM detector,
the host checks and the training's restart produce, pinned word for word before they move to the
words package (supervisor.notify.mails) and render.py.

Each text is compared with a file under tests/data/golden/tracker/. To accept a deliberate change of
wording, run with GOLDEN_UPDATE=1 and review the diff of those files.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest

from supervisor import config
from supervisor.cli import render
from supervisor.clock import FakeClock
from supervisor.disk.floor import DiskFloor
from supervisor.gpu.hostcheck import HostCheck
from supervisor.gpu.monitor import GpuMonitor
from supervisor.gpu.nvml import GpuProcess, GpuSample, GpuSnapshot, XidEvent
from supervisor.gpu.oom import EvidenceSources, OomDetector
from supervisor.interfaces import TrainingInfo
from supervisor.notify.alerts import Alerts
from supervisor.progress.tracker import ProgressTracker
from supervisor.statefile import StateStore
from supervisor.states import TrainingState
from tests.fixtures.context import ConfiguredContext
from tests.waiting import wait_until

GOLDEN = Path(__file__).parents[1] / "data" / "golden" / "tracker"
GiB = 1024**3
UPDATE = os.environ.get("GOLDEN_UPDATE") == "1"


# --- plumbing -----------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _zone(monkeypatch):
    """A zone that is not UTC, so a time written in UTC and one written in local time differ."""
    monkeypatch.setenv("TZ", "CET-1")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


class Tap:
    """Real Alerts, with every call recorded as it was made (subject and body before any sanitising)."""

    def __init__(self, alerts: Alerts):
        self.alerts = alerts
        self.calls: list[dict] = []

    def event(self, key, kind, severity, subject, body):
        self.calls.append({"what": "event", "key": key, "kind": kind, "severity": str(severity),
                           "subject": subject, "body": body})
        return self.alerts.event(key, kind, severity, subject, body)

    def fire(self, key, kind, severity, subject, body):
        self.calls.append({"what": "fire", "key": key, "kind": kind, "severity": str(severity),
                           "subject": subject, "body": body})
        return self.alerts.fire(key, kind, severity, subject, body)

    def resolve(self, key):
        self.calls.append({"what": "resolve", "key": key})
        return self.alerts.resolve(key)

    def __getattr__(self, name):
        return getattr(self.alerts, name)


def context(tmp_path: Path, clock, doc: dict | None = None) -> tuple[ConfiguredContext, Tap]:
    cfg = config.from_dict({"state_dir": str(tmp_path / "state"), **(doc or {})})
    tap = Tap(Alerts(cfg.alerts, clock, cfg.state_dir, None, hostname="gpu-box"))
    return ConfiguredContext(clock, StateStore(cfg.state_dir), tap, cfg), tap  # type: ignore[arg-type]


def mail_text(call: dict) -> str:
    return (f"key: {call['key']}\nkind: {call['kind']}\nseverity: {call['severity']}\n"
            f"subject: {call['subject']}\n---\n{call['body']}")


def check(name: str, text: str, tmp_path: Path | None = None) -> None:
    if tmp_path is not None:
        text = text.replace(str(tmp_path), "<tmp>")
    path = GOLDEN / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no golden {path}: run with GOLDEN_UPDATE=1 and review it"
    assert text == path.read_text(), f"{name} differs from {path}"


def only(tap: Tap, kind: str) -> dict:
    (c,) = [c for c in tap.calls if c.get("kind") == kind]
    return c


# --- progress: the status line, the summary, the estimate mail ------------------------------------------------

def tracker(ctx: ConfiguredContext, gpu=None) -> ProgressTracker:
    return ProgressTracker(ctx, ctx.config.progress, price_per_hour=ctx.config.price_per_hour, currency=ctx.config.currency, gpu=gpu,
                           job_env=ctx.config.training.env, job_user=ctx.config.training.user)


def progress_line(tr: ProgressTracker, now: float) -> str:
    return render.progress_line({"now": now, "training": {"progress": tr.snapshot(now)}, "cost": tr.cost(now)})


class Gpu:
    """The GPU monitor at its seam: peak memory and the status block."""

    def peak_mem_bytes(self):
        return 70 * GiB

    def status(self):
        return {"gpus": [{"index": 0, "mem_total_bytes": 80 * GiB}], "gpu_error": None}


def tsup(step, max_steps=None, **kw) -> str:
    import json

    return "TSUP " + json.dumps({"step": step, **({"max_steps": max_steps} if max_steps else {}), **kw})


PRICED = {"price_per_hour": 3.90, "currency": "EUR"}


def test_progress_lines(tmp_path):
    out = []
    clock = FakeClock()
    ctx, _ = context(tmp_path / "a", clock, PRICED)
    tr = tracker(ctx)
    out.append(f"before any run: {progress_line(tr, clock.time())!r}")
    t0 = clock.time()
    tr.start_run(1, t0)
    clock.advance(60)
    out.append(f"nothing known: {progress_line(tr, clock.time())}")
    for k in range(1, 204):
        clock.advance(10)
        tr.feed_line(tsup(5 * k, 3750, loss=1.21, tokens=20480 * k), clock.time())
    out.append(f"running: {progress_line(tr, clock.time())}")
    clock.advance(900)
    out.append(f"stalled: {progress_line(tr, clock.time())}")
    tr.end_run(1, clock.time())
    clock.advance(3600)
    out.append(f"ended: {progress_line(tr, clock.time())}")

    clock = FakeClock()
    ctx, _ = context(tmp_path / "b", clock, PRICED)
    tr = tracker(ctx)
    tr.start_run(1, clock.time())
    for k in range(1, 11):
        clock.advance(20)
        tr.feed_line(tsup(k * 10, 100), clock.time())
    tr.feed_line(tsup(100, 100, done=True), clock.time())
    clock.advance(600)
    out.append(f"finished: {progress_line(tr, clock.time())}")

    clock = FakeClock()
    ctx, _ = context(tmp_path / "c", clock, PRICED)
    tr = tracker(ctx)
    tr.start_run(1, clock.time())
    tr.feed_line("  Num Epochs = 4", clock.time())
    for k in range(1, 31):
        clock.advance(60)
        tr.feed_line(f"{{'loss': 0.5, 'learning_rate': 1e-05, 'epoch': {k * 0.05:.2f}}}", clock.time())
    out.append(f"epochs only: {progress_line(tr, clock.time())}")

    clock = FakeClock()
    ctx, _ = context(tmp_path / "d", clock)
    tr = tracker(ctx)
    tr.start_run(1, clock.time())
    for k in range(1, 40):
        clock.advance(30)
        tr.feed_line(tsup(k, 5000), clock.time())
    out.append(f"slow steps, no price: {progress_line(tr, clock.time())}")
    check("progress_lines", "\n".join(out) + "\n")


def test_progress_summaries(tmp_path):
    out = []
    clock = FakeClock()
    ctx, _ = context(tmp_path / "a", clock, PRICED)
    tr = tracker(ctx)
    out.append(f"== before any run\n{tr.email_summary(clock.time())}")
    t0 = clock.time()
    tr.start_run(1, t0)
    clock.advance(60)
    out.append(f"== nothing known\n{tr.email_summary(clock.time())}")
    for k in range(1, 31):
        clock.advance(10)
        tr.feed_line(tsup(k * 10, 1000, loss=0.5, tokens=4096 * k * 10, epoch=k * 0.01), clock.time())
    out.append(f"== running\n{tr.email_summary(clock.time())}")
    clock.advance(900)
    out.append(f"== stalled\n{tr.email_summary(clock.time())}")
    tr.end_run(1, clock.time())
    out.append(f"== ended\n{tr.email_summary(clock.time())}")
    check("progress_summaries", "\n".join(out) + "\n")


def _estimate(tmp_path, doc, gpu, feed_steps: bool) -> dict:
    clock = FakeClock()
    ctx, tap = context(tmp_path, clock, doc)
    tr = tracker(ctx, gpu=gpu)
    tr.start_run(4, clock.time())
    for k in range(1, 91):
        clock.advance(10)
        if feed_steps:
            tr.feed_line(tsup(5 * k, 3750), clock.time())
        tr.maybe_early_estimate(clock.time())
    if not feed_steps:
        clock.advance(15 * 60)
        tr.maybe_early_estimate(clock.time())
    return only(tap, "early_estimate")


def test_estimate_mail_fits_budget_with_gpu_peak(tmp_path):
    doc = {**PRICED, "progress": {"estimate_email": True, "estimate_after": "15m", "budget": 10.0}}
    check("estimate_fits", mail_text(_estimate(tmp_path, doc, Gpu(), True)))


def test_estimate_mail_over_budget(tmp_path):
    doc = {**PRICED, "progress": {"estimate_email": True, "budget": 5.0}}
    check("estimate_over_budget", mail_text(_estimate(tmp_path, doc, None, True)))


def test_estimate_mail_no_price(tmp_path):
    check("estimate_no_price", mail_text(_estimate(tmp_path, {"progress": {"estimate_email": True}}, Gpu(), True)))


def test_estimate_mail_unknown_finish(tmp_path):
    check("estimate_unknown", mail_text(_estimate(tmp_path, {**PRICED, "progress": {"estimate_email": True}},
                                                  None, False)))


# --- GPUs: status lines and mails --------------------------------------------------------------------------------

class Probe:
    """The NVML probe at its seam: hands out the snapshots a test scripts."""

    def __init__(self):
        self.next = GpuSnapshot()

    def sample(self) -> GpuSnapshot:
        return self.next

    def close(self) -> None:
        pass


class Job:
    def __init__(self, pids):
        self._pids = pids

    def info(self):  # pragma: no cover
        raise NotImplementedError

    def pids(self):
        return set(self._pids)


H100 = "NVIDIA H100 80GB HBM3"


def monitor(tmp_path, clock, doc=None, pids=()) -> tuple[GpuMonitor, Probe, Tap]:
    ctx, tap = context(tmp_path, clock, {"gpu": {"poll_interval": "5s", **(doc or {})}})
    probe = Probe()
    return GpuMonitor(ctx, ctx.config.gpu, probe=probe, training=Job(pids)), probe, tap  # type: ignore[arg-type]


def gpu_lines(m: GpuMonitor) -> list[str]:
    return render.gpu_lines(m.status())


def test_gpu_lines(tmp_path):
    clock = FakeClock()
    m, probe, _ = monitor(tmp_path, clock, pids={100})
    out = [f"before the first poll: {gpu_lines(m)!r}"]
    probe.next = GpuSnapshot(error="NVML reports no GPUs", driver_version="550.54.15")
    m.poll()
    out.append(f"no GPUs: {gpu_lines(m)!r}")
    probe.next = GpuSnapshot(gpus=(
        GpuSample(0, H100, "GPU-0", 97.0, int(71.2 * GiB), 80 * GiB,
                  (GpuProcess(100, int(70.1 * GiB)), GpuProcess(999999, GiB))),
        GpuSample(1, "NVIDIA L4", "GPU-1", 50.0, 10 * GiB, 24 * GiB,
                  tuple(GpuProcess(200 + i, i * GiB) for i in range(6)) + (GpuProcess(100, None),)),
        GpuSample(2, None, None, None, None, None, mig=True),
        GpuSample(3, "NVIDIA A10G", "GPU-3", None, 2 * GiB, 24 * GiB),
        GpuSample(4, "NVIDIA A10G", "GPU-4", None, None, None, error="GPU is lost (fell off the bus?)"),
        GpuSample(5, H100, "GPU-5", 3.4, 0, 80 * GiB),
    ), driver_version="550.54.15")
    m.poll()
    out.append("eight kinds:")
    out.extend(gpu_lines(m))
    check("gpu_lines", "\n".join(out) + "\n")


def test_gpu_memory_limit_mail(tmp_path):
    clock = FakeClock()
    m, probe, tap = monitor(tmp_path, clock, {"mem_limit_fraction": 0.95, "mem_limit_samples": 3})
    probe.next = GpuSnapshot(gpus=(GpuSample(0, H100, "GPU-0", 90.0, 40 * GiB, 80 * GiB),
                                   GpuSample(1, H100, "GPU-1", 99.0, int(0.97 * 80 * GiB), 80 * GiB),
                                   GpuSample(2, H100, "GPU-2", 99.0, int(0.99 * 80 * GiB), 80 * GiB)))
    for _ in range(3):
        m.poll()
        clock.advance(5)
    check("gpu_mem_limit", mail_text([c for c in tap.calls if c.get("kind") == "gpu_mem_limit"][-1]))


def test_gpu_lost_and_xid_mails(tmp_path):
    clock = FakeClock()
    m, probe, tap = monitor(tmp_path, clock)
    probe.next = GpuSnapshot(gpus=(GpuSample(0, H100, "GPU-0", 90.0, GiB, 80 * GiB),
                                   GpuSample(1, H100, "GPU-1", None, None, None, error="GPU is lost"),),
                             events=(XidEvent(1, "GPU-1", 79), XidEvent(0, "GPU-0", 31), XidEvent(None, None, 999)))
    m.poll()
    check("gpu_failed", mail_text(only(tap, "gpu_failed")))
    xids = [c for c in tap.calls if c.get("kind") == "gpu_xid"]
    check("gpu_xid", "\n\n=====\n\n".join(mail_text(c) for c in xids))


def test_nvml_stops_answering_mail(tmp_path):
    clock = FakeClock()
    m, probe, tap = monitor(tmp_path, clock)
    probe.next = GpuSnapshot(gpus=(GpuSample(0, H100, "GPU-0", 90.0, GiB, 80 * GiB),))
    m.poll()
    probe.next = GpuSnapshot(error="NVML error: driver not loaded")
    m.poll()
    check("gpu_nvml_gone", mail_text(only(tap, "gpu_failed")))


# --- out of memory ---------------------------------------------------------------------------------------------

NEW_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
           "of 79.15 GiB of which 1.06 GiB is free. Process 1234 has 78.08 GiB memory in use. Of the allocated "
           "memory 75.51 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch but unallocated.")
OLD_OOM = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
           "14.50 GiB already allocated; 4.75 MiB free; 14.71 GiB reserved in total by PyTorch)")
TRACE = ["{'loss': 0.9, 'learning_rate': 1e-05, 'epoch': 0.5}", "Traceback (most recent call last):",
         '  File "train.py", line 10, in <module>']


def quiet(tmp_path) -> EvidenceSources:
    return EvidenceSources(kmsg=str(tmp_path / "no-kmsg"), dmesg=None, vmstat=None, memory_events=[])


def detector(tmp_path, doc=None, sources=None) -> tuple[OomDetector, Tap, FakeClock]:
    clock = FakeClock()
    ctx, tap = context(tmp_path, clock, doc)
    return OomDetector(ctx, evidence=sources or quiet(tmp_path), log_path=ctx.config.training.log), tap, clock


@pytest.mark.parametrize("name,line,log", [("cuda_oom_new", NEW_OOM, "/workspace/train.log"),
                                           ("cuda_oom_old", OLD_OOM, None),
                                           ("cuda_oom_bare", "RuntimeError: CUDA error: out of memory", None)])
def test_cuda_oom_mail(tmp_path, name, line, log):
    det, tap, clock = detector(tmp_path, {"training": {"log": log}} if log else None)
    for x in [*TRACE, line]:
        det.feed_line(x, clock.time())
    check(name, mail_text(only(tap, "cuda_oom")))


def test_host_alloc_and_nccl_mails(tmp_path):
    det, tap, clock = detector(tmp_path, {"training": {"log": "/workspace/train.log"}})
    det.feed_line("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes.", clock.time())
    det.feed_line("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12)", clock.time())
    check("host_alloc", mail_text(only(tap, "host_alloc_failed")))
    check("nccl_timeout", mail_text(only(tap, "nccl_timeout")))


def test_host_oom_from_the_log_mail(tmp_path):
    det, tap, clock = detector(tmp_path)
    for x in [*TRACE, "Out of memory: Killed process 4321 (python) total-vm:99999kB"]:
        det.feed_line(x, clock.time())
    check("host_oom_log", mail_text(only(tap, "host_oom_kill")))


def kmsg_record(seq: int, ts_s: float, text: str) -> str:
    return f"3,{seq},{int(ts_s * 1e6)},-;{text}\n SUBSYSTEM=memory\n"


def test_host_oom_at_exit_mail(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(kmsg_record(1, 10.0, "Linux version 6.1"))
    det, tap, clock = detector(tmp_path, {"training": {"log": "/workspace/train.log"}},
                               EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[]))
    det.feed_line("step 10", clock.time())
    with open(kmsg, "a") as f:
        f.write(kmsg_record(2, 30.0, "Out of memory: Killed process 4321 (python) total-vm:9999kB"))
    info = TrainingInfo(state=TrainingState.FAILED, exit_code=-9, signal="SIGKILL", started_at=1.0, run_id=3)
    assert det.check_exit(info) == "killed by the kernel OOM killer"
    check("host_oom_exit", mail_text(only(tap, "host_oom_kill")), tmp_path)


# --- host memory and disk --------------------------------------------------------------------------------------

VM = namedtuple("VM", "total available")
DU = namedtuple("DU", "total used free")


def test_host_memory_low_mail(tmp_path):
    clock = FakeClock()
    ctx, tap = context(tmp_path, clock, {"alerts": {"host_mem_min_pct": 5.0}})
    HostCheck(ctx, ctx.config.alerts, virtual_memory=lambda: VM(100 * GiB, 4 * GiB)).poll()
    check("host_mem_low", mail_text(only(tap, "host_mem_low")))


def test_disk_full_mail(tmp_path):
    clock = FakeClock()
    (tmp_path / "out").mkdir()
    ctx, tap = context(tmp_path, clock, {"alerts": {"disk_free_min_pct": 5.0, "host_mem_min_pct": 0.0,
                                                    "disk_paths": [str(tmp_path / "out")]}})
    DiskFloor(ctx, ctx.config.alerts, [str(tmp_path)], disk_usage=lambda p: DU(100 * GiB, 96 * GiB, 4 * GiB)).poll()
    check("disk_full", mail_text(only(tap, "disk_full")), tmp_path)


# --- the training restarted ------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_training_restarted_mail(tmp_path, monkeypatch):
    import subprocess

    from supervisor.training.job import Training

    monkeypatch.setenv("TRAIN_SUPERVISOR_NO_SCOPE", "1")
    clock = FakeClock()
    ctx, tap = context(tmp_path, clock, {"socket": str(tmp_path / "ctl.sock"), "training": {
        "command": "exit 3", "log": str(tmp_path / "train.log"), "workdir": str(tmp_path),
        "restart": "on-failure", "max_restarts": 2, "restart_backoff": "10s"}})
    t = Training(ctx, ctx.config.training)
    try:
        t.start()
        wait_until(lambda: (t.poll(), t.state == TrainingState.FAILED)[1], 15, what="FAILED")
    finally:
        subprocess.run(["tmux", "-S", t.tmux.socket, "kill-server"], capture_output=True)
    check("training_restarted", mail_text(only(tap, "training_restarted")), tmp_path)
