"""OOM signatures (pure), the detector on a followed log with real Alerts and a real SMTP server,
and the kernel-evidence judgement of a SIGKILL from real files in /dev/kmsg and dmesg formats."""

from __future__ import annotations

import os
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.config import from_dict
from supervisor.gpu.oom import (
    CHILD_SIGKILL,
    CUDA_OOM,
    HOST_ALLOC,
    HOST_OOM,
    NCCL_TIMEOUT,
    EvidenceSources,
    OomDetector,
    classify,
)
from supervisor.interfaces import TrainingInfo
from supervisor.notify.alerts import Alerts
from supervisor.notify.mail import SmtpMailer
from supervisor.statefile import StateStore
from supervisor.states import TrainingState
from supervisor.training.logfollow import LogFollower
from tests.fixtures.context import ConfiguredContext
from tests.fixtures.nvml import make_ctx
from tests.waiting import wait_until

NEW_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
           "of 79.15 GiB of which 1.06 GiB is free. Process 1234 has 78.08 GiB memory in use. Of the allocated "
           "memory 75.51 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch but unallocated. If "
           "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
           "to avoid fragmentation.  See documentation for Memory Management")
OLD_OOM = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
           "14.50 GiB already allocated; 4.75 MiB free; 14.71 GiB reserved in total by PyTorch)")


@pytest.mark.parametrize("line,kind", [
    (NEW_OOM, CUDA_OOM),
    (OLD_OOM, CUDA_OOM),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 312.00 MiB. GPU", CUDA_OOM),
    ("[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 3 has a total "
     "capacity of 79.10 GiB of which 605.88 MiB is free.", CUDA_OOM),                     # Accelerate/Axolotl DDP
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 11.89 GiB. GPU 0 has a total capacity of "
     "22.17 GiB of which 3.38 GiB is free.", CUDA_OOM),                                  # Unsloth notebook-style
    ("RuntimeError: CUDA error: out of memory", CUDA_OOM),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", CUDA_OOM),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", CUDA_OOM),
    ("triton.runtime.errors: CUDA_ERROR_OUT_OF_MEMORY: out of memory", CUDA_OOM),
    ("gpu-7:1234:1250 [0] include/alloc.h:103 NCCL WARN Cuda failure 'out of memory'", CUDA_OOM),
    ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
     "1073741824 bytes.", CUDA_OOM),
    ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 4.00 GiB.", CUDA_OOM),
    ("RuntimeError: [enforce fail at alloc_cpu.cpp:83] err == 0. DefaultCPUAllocator: can't allocate memory: "
     "you tried to allocate 1000000 bytes.", HOST_ALLOC),
    ("MemoryError", HOST_ALLOC),
    ("numpy.core._exceptions._ArrayMemoryError: Unable to allocate 3.2 GiB for an array", HOST_ALLOC),
    ("Out of memory: Killed process 4321 (python) total-vm:99999kB, anon-rss:88888kB", HOST_OOM),
    ("Memory cgroup out of memory: Killed process 99 (python3) total-vm:1kB", HOST_OOM),
    ("oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python,pid=4321,uid=0", HOST_OOM),
    ("RuntimeError: DataLoader worker (pid 12345) is killed by signal: Killed. ", CHILD_SIGKILL),
    ("  exitcode  : -9 (pid: 777)", CHILD_SIGKILL),
    ("  traceback : Signal 9 (SIGKILL) received by PID 777", CHILD_SIGKILL),
    ("[launch.py:319:sigkill_handler] Killing subprocess 5; ... exits with return code = -9", CHILD_SIGKILL),
    ("[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800123 milliseconds", NCCL_TIMEOUT),
])
def test_signatures(line, kind):
    m = classify(line)
    assert m is not None and m.kind == kind and m.line == line.strip()


@pytest.mark.parametrize("line", [
    "{'loss': 1.2034, 'grad_norm': 0.51, 'learning_rate': 2e-05, 'epoch': 0.3}",
    '    if "CUDA out of memory" in str(e):',
    "        except torch.cuda.OutOfMemoryError:",
    "Tip: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "java.lang.OutOfMemoryError: Java heap space",
    "🦥 Unsloth: Will patch your computer to enable 2x faster free finetuning.",
    "gradient_checkpointing enabled to avoid out-of-memory errors",
    " 45%|████▌     | 450/1000 [10:00<12:13,  1.33s/it]",
    "",
])
def test_not_signatures(line):
    assert classify(line) is None


def test_details_new_and_old_format():
    m = classify(NEW_OOM)
    assert (m.gpu, m.tried, m.total, m.free, m.reserved_unallocated) == \
        (0, "2.00 GiB", "79.15 GiB", "1.06 GiB", "1.90 GiB")
    o = classify(OLD_OOM)
    assert (o.gpu, o.tried, o.total, o.free) == (0, "20.00 MiB", "15.78 GiB", "4.75 MiB")
    assert classify("Out of memory: Killed process 4321 (python)").pid == 4321
    assert classify("  exitcode  : -9 (pid: 777)").pid == 777


@given(st.text(max_size=300))
def test_classify_never_raises(text):
    classify(text)


# --- the detector on a followed log, mailing through a real SMTP server ---------------------------

def smtp_ctx(tmp_path, clock, port: int, log_path: str) -> ConfiguredContext:
    cfg = from_dict({"state_dir": str(tmp_path / "state"), "training": {"log": log_path},
                     "email": {"to": ["owner@example.com"], "smtp_host": "127.0.0.1", "smtp_port": port,
                               "security": "none", "timeout": "5s"}})
    alerts = Alerts(cfg.alerts, clock, cfg.state_dir, SmtpMailer(cfg.email, hostname="gpu-box"),
                    hostname="gpu-box")
    return ConfiguredContext(clock, StateStore(cfg.state_dir), alerts, cfg)


def quiet_sources(tmp_path) -> EvidenceSources:
    return EvidenceSources(kmsg=str(tmp_path / "no-kmsg"), dmesg=None, vmstat=None, memory_events=[])


def test_oom_line_appended_mails_exactly_once_within_one_poll(smtp_server, tmp_path, clock):
    log_path = tmp_path / "train.log"
    log_path.write_text("old run: CUDA out of memory\n")  # before the daemon started: not re-alerted
    ctx = smtp_ctx(tmp_path, clock, smtp_server.port, str(log_path))
    det = OomDetector(ctx, evidence=quiet_sources(tmp_path), log_path=ctx.config.training.log)
    f = LogFollower(str(log_path), [det], start_at_end=True)
    f.poll(clock.time())
    with open(log_path, "a") as fh:
        fh.write("{'loss': 0.9}\n" + "Traceback (most recent call last):\n"
                 "  File \"train.py\", line 10, in <module>\n" + NEW_OOM + "\n")
    t0 = time.monotonic()
    f.poll(clock.time())  # one poll
    (msg,) = smtp_server.wait_for(1, timeout=10)
    assert time.monotonic() - t0 < 10
    subject = " ".join(str(msg["Subject"]).split())  # unfold the header
    assert "CUDA out of memory on GPU 0" in subject and "tried to allocate 2.00 GiB" in subject
    body = msg.get_payload(decode=True).decode() if not msg.is_multipart() else msg.get_payload(0).get_payload()
    assert NEW_OOM in body and "Traceback" in body
    for advice in ("per_device_train_batch_size", "sequence length", "gradient checkpointing", "8-bit optimizer"):
        assert advice in body
    assert str(log_path) in body
    # every rank prints the same traceback, torchrun repeats it in its summary: still one mail
    with open(log_path, "a") as fh:
        for r in range(8):
            fh.write(f"[rank{r}]: {NEW_OOM}\n")
    for _ in range(3):
        f.poll(clock.time())
        clock.advance(2)
    ctx.alerts.tick()
    wait_until(lambda: ctx.alerts.outbox_size() == 0, timeout=10, what="outbox drained")
    assert len(smtp_server.messages) == 1
    assert det.counts()[CUDA_OOM] == 9


def test_next_run_mails_again(smtp_server, tmp_path, clock):
    log_path = tmp_path / "train.log"
    ctx = smtp_ctx(tmp_path, clock, smtp_server.port, str(log_path))
    det = OomDetector(ctx, evidence=quiet_sources(tmp_path))
    f = LogFollower(str(log_path), [det])
    log_path.write_text(OLD_OOM + "\n")
    f.poll(clock.time())
    smtp_server.wait_for(1)
    clock.advance(600)
    det.reset(clock.time())  # the user fixed the batch size and started again, within the hour
    with open(log_path, "a") as fh:
        fh.write(NEW_OOM + "\n")
    f.poll(clock.time())
    ctx.alerts.flush(10)  # the daemon's alerts tick: a kick while a delivery runs leaves it to the tick
    smtp_server.wait_for(2)
    assert len({m["Subject"] for m in smtp_server.messages}) == 2


def test_host_alloc_and_nccl_alerts(tmp_path, clock):
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=quiet_sources(tmp_path))
    det.feed_line("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes.", clock.time())
    det.feed_line("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)", clock.time())
    det.feed_line("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(...)", clock.time())
    ev = [r for r in ctx.alerts.recent() if r["what"] == "event"]
    assert [r["kind"] for r in ev] == ["host_alloc_failed", "nccl_timeout"]
    assert "dataloader_num_workers" in ev[0]["body"] and "NCCL_DEBUG=INFO" in ev[1]["body"]


def test_subject_cannot_inject_headers(tmp_path, clock):
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=quiet_sources(tmp_path))
    det.feed_line("CUDA out of memory. Tried to allocate 1.00 GiB\rBcc: evil@example.com", clock.time())
    (r,) = [r for r in ctx.alerts.recent() if r["what"] == "event"]
    assert "\r" not in r["subject"] and "\n" not in r["subject"]


# --- SIGKILL: kernel OOM killer or not ------------------------------------------------------------

def kmsg_record(seq: int, ts_s: float, text: str, prio: int = 3) -> str:
    return f"{prio},{seq},{int(ts_s * 1e6)},-;{text}\n SUBSYSTEM=memory\n"


def killed(**kw) -> TrainingInfo:
    d = {"state": TrainingState.FAILED, "exit_code": -9, "signal": "SIGKILL", "started_at": 1.0, "run_id": 3}
    d.update(kw)
    return TrainingInfo(**d)


def host_oom_events(ctx) -> list[dict]:
    return [r for r in ctx.alerts.recent() if r["what"] == "event" and r["kind"] == "host_oom_kill"]


@pytest.fixture
def kmsg(tmp_path):
    p = tmp_path / "kmsg"
    p.write_text(kmsg_record(1, 10.0, "Linux version 6.1") +
                 kmsg_record(2, 20.0, "Out of memory: Killed process 111 (old-job) total-vm:1kB"))  # earlier
    return p


def test_sigkill_with_kernel_record_is_host_oom(tmp_path, clock, kmsg):
    ctx = make_ctx(tmp_path, clock, {"training": {"log": "/workspace/train.log"}})
    det = OomDetector(ctx, evidence=EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[]))
    with open(kmsg, "a") as f:
        f.write(kmsg_record(3, 30.0, "oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=4321,uid=0"))
        f.write(kmsg_record(4, 30.0, "Out of memory: Killed process 4321 (python) total-vm:9999kB"))
    assert det.check_exit(killed()) == "killed by the kernel OOM killer"
    (a,) = host_oom_events(ctx)
    assert a["severity"] == "critical" and "OOM killer" in a["subject"]
    assert "Killed process 4321 (python)" in a["body"] and "old-job" not in a["body"]
    assert "dataloader_num_workers" in a["body"] and "exit code -9 (SIGKILL)" in a["body"]


def test_sigkill_without_evidence_is_not_called_oom(tmp_path, clock, kmsg):
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[]))
    assert det.check_exit(killed()) == "killed by SIGKILL (no OOM evidence)"
    assert det.check_exit(killed(exit_code=137, signal=None)) == "killed by SIGKILL (no OOM evidence)"
    assert host_oom_events(ctx) == []


def test_other_exits_are_not_judged(tmp_path, clock, kmsg):
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[]))
    with open(kmsg, "a") as f:
        f.write(kmsg_record(3, 30.0, "Out of memory: Killed process 4321 (python)"))
    assert det.check_exit(killed(exit_code=1, signal=None)) is None
    assert det.check_exit(killed(state=TrainingState.STOPPED)) is None  # our own stop escalated to SIGKILL
    assert host_oom_events(ctx) == []


def test_dmesg_fallback_by_timestamp(tmp_path, clock):
    out = tmp_path / "dmesg.txt"
    out.write_text("[   12.000000] Out of memory: Killed process 1 (before)\n[   50.500000] usb 1-1: new device\n")
    src = EvidenceSources(kmsg=str(tmp_path / "absent"), dmesg=["cat", str(out)], vmstat=None, memory_events=[])
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=src)
    assert det.check_exit(killed()) == "killed by SIGKILL (no OOM evidence)"
    with open(out, "a") as f:
        f.write("[   90.250000] Memory cgroup out of memory: Killed process 4321 (python) total-vm:1kB\n")
    assert det.check_exit(killed()) == "killed by the kernel OOM killer"
    (a,) = host_oom_events(ctx)
    assert "Memory cgroup out of memory: Killed process 4321" in a["body"] and "(before)" not in a["body"]


def test_cgroup_and_vmstat_counters(tmp_path, clock):
    events = tmp_path / "memory.events"
    vmstat = tmp_path / "vmstat"
    events.write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\noom_group_kill 0\n")
    vmstat.write_text("nr_free_pages 100\noom_kill 7\n")
    src = EvidenceSources(kmsg=None, dmesg=None, vmstat=str(vmstat), memory_events=[str(events)])
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=src)
    assert det.check_exit(killed()) == "killed by SIGKILL (no OOM evidence)"  # counts from before the run
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert det.check_exit(killed()) == "killed by the kernel OOM killer"
    (a,) = host_oom_events(ctx)
    assert f"cgroup OOM-kill counter {events}: oom_kill 1 -> 2" in a["body"]


def test_new_run_takes_a_new_baseline(tmp_path, clock):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("oom_kill 0\n")
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=EvidenceSources(kmsg=None, dmesg=None, vmstat=str(vmstat), memory_events=[]))
    vmstat.write_text("oom_kill 1\n")  # an OOM kill during the previous run
    det.reset(clock.time() + 1)
    assert det.check_exit(killed()) == "killed by SIGKILL (no OOM evidence)"


def test_torchrun_child_sigkill_in_log_with_evidence(tmp_path, clock, kmsg):
    """torchrun exits 1 when a worker is OOM-killed; its summary names the worker's SIGKILL."""
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[]))
    with open(kmsg, "a") as f:
        f.write(kmsg_record(3, 30.0, "Out of memory: Killed process 4321 (python)"))
    det.feed_line("  exitcode  : -9 (pid: 4321)", clock.time())
    (a,) = host_oom_events(ctx)
    assert "exitcode  : -9" in a["body"] and "Killed process 4321" in a["body"]
    assert det.check_exit(killed(exit_code=1, signal=None)) == "killed by the kernel OOM killer"
    assert len(host_oom_events(ctx)) == 1  # judged again at the end, mailed once


def test_torchrun_child_sigkill_without_evidence(tmp_path, clock, kmsg):
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[]))
    det.feed_line("RuntimeError: DataLoader worker (pid 4321) is killed by signal: Killed.", clock.time())
    assert host_oom_events(ctx) == []
    assert det.check_exit(killed(exit_code=1, signal=None)) == "a worker was killed by SIGKILL (no OOM evidence)"


def test_unreadable_sources_never_claim_oom(tmp_path, clock):
    src = EvidenceSources(kmsg=str(tmp_path), dmesg=["false"], vmstat=str(tmp_path / "x"),
                          memory_events=[str(tmp_path / "y")])
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=src)
    assert det.check_exit(killed()) == "killed by SIGKILL (no OOM evidence)"


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_real_kmsg_reads_without_blocking():
    t0 = time.monotonic()
    lines, src = EvidenceSources(dmesg=None).kernel_lines()
    assert src == "/dev/kmsg" and time.monotonic() - t0 < 5
    assert all(x.seq is not None for x in lines)


def test_default_sources_construct(tmp_path, clock):
    det = OomDetector(make_ctx(tmp_path, clock))
    assert det.check_exit(killed(exit_code=0, signal=None, state=TrainingState.FINISHED)) is None
    assert sys.platform != "linux" or isinstance(det.sources.memory_events, list)


# --- a restart gap; the runner's own banner ---------------------------------------------------------

def test_run_that_ended_while_no_daemon_ran_is_judged_from_its_start(tmp_path, clock):
    """The OOM kill happened before this detector (a restarted daemon) took its baseline."""
    kmsg = tmp_path / "kmsg"
    boot_now = time.monotonic()
    kmsg.write_text(kmsg_record(1, boot_now - 3600, "Out of memory: Killed process 1 (a run before)")
                    + kmsg_record(2, boot_now - 60, "Out of memory: Killed process 4321 (python)"))
    src = EvidenceSources(kmsg=str(kmsg), dmesg=None, vmstat=None, memory_events=[])
    started = clock.time() - 600   # the run started ten minutes ago; the kill was a minute ago
    fresh = OomDetector(make_ctx(tmp_path / "a", clock), evidence=src)
    assert fresh.check_exit(killed(started_at=started)) == "killed by SIGKILL (no OOM evidence)"
    ctx = make_ctx(tmp_path / "b", clock)
    det = OomDetector(ctx, evidence=src)
    det.resume_run(started)
    assert det.check_exit(killed(started_at=started)) == "killed by the kernel OOM killer"
    (a,) = host_oom_events(ctx)
    assert "Killed process 4321" in a["body"] and "a run before" not in a["body"]
    assert a["key"] == f"oom:host:{int(started)}"   # the run's key: a second daemon's replay is deduplicated


def test_the_runners_banner_never_raises_an_oom_alert(tmp_path, clock):
    """The banner repeats the command; a command that mentions out-of-memory (even across lines) is
    not the job running out of memory. The real runner writes the log, the real follower reads it."""
    import json
    import subprocess

    cmd = "true 'retry after\nRuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB' \\\n  DataLoader"
    run_dir = tmp_path / "runs" / "1"
    run_dir.mkdir(parents=True)
    log_path = tmp_path / "train.log"
    spec = {"run_id": 1, "command": cmd, "log": str(log_path), "run_dir": str(run_dir), "shell": "/bin/sh"}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "supervisor.training.runner", str(run_dir / "spec.json")],
                       capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = log_path.read_text()
    assert "CUDA out of memory" in text and len(text.strip().splitlines()) == 2   # start and end banners
    ctx = make_ctx(tmp_path, clock)
    det = OomDetector(ctx, evidence=quiet_sources(tmp_path))
    f = LogFollower(str(log_path), [det])
    assert f.poll(clock.time()) == 2
    assert [r for r in ctx.alerts.recent() if r["what"] == "event"] == []
    det.feed_line("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", clock.time())  # the job's own
    assert [r["kind"] for r in ctx.alerts.recent() if r["what"] == "event"] == ["cuda_oom"]
