"""GPU memory that bills for nothing (issue 40): the pure rule exhaustively, a real PID namespace for
"not visible in this container", and the real daemon with the fake NVML: a real process holding
memory at 0 % is named with its user and command, a dead PID is told as dead, the idle rule never
counts such memory, and gpu.on_waste = "stop" stops the machine (saving first) once nothing trains."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from supervisor.gpu import waste as w
from supervisor.gpu.wastewatch import host_pid_namespace
from tests.fixtures.hf_writer import HFWriter
from tests.fixtures.nvml import gpu
from tests.idle.test_idle_e2e import config, lines, wait_idle
from tests.waiting import wait_until

GIB = 1 << 30


def h(pid: int = 100, mem: int | None = 60 * GIB, training: bool = False, exists: bool = True, g: int = 0) -> w.Holder:
    return w.Holder(g, pid, mem, training, exists, "alice", "python kernel.py")


@pytest.mark.parametrize("holder,util,host,alive,want", [
    (h(training=True), 0.0, True, True, ""),              # the training's own memory is never waste
    (h(), 0.0, True, False, w.IDLE),                       # another process, its GPU at 0 %
    (h(), 0.0, True, True, w.IDLE),                        # ... whether or not our training runs elsewhere
    (h(), 37.0, True, False, ""),                          # its GPU works
    (h(), None, True, False, ""),                          # utilization unknown: never "idle"
    (h(exists=False), 80.0, True, False, w.DEAD),          # the PID is gone, the driver still holds it
    (h(mem=0), 0.0, True, False, ""),
    (h(mem=None), 0.0, True, False, ""),                   # memory NotSupported: nothing to say
    (h(exists=False), 0.0, False, False, w.NOT_VISIBLE),   # a container: a host PID, never "dead"
    (h(exists=True), 0.0, False, False, w.NOT_VISIBLE),    # ... never looked up either
    (h(exists=False), 0.0, False, True, ""),               # ... and while our training runs it may be ours
    (h(exists=False), 50.0, False, False, ""),
])
def test_what_is_waste(holder, util, host, alive, want):
    assert w.kind_of(holder, util, host, alive) == want


def test_waste_counts_from_when_it_began_and_a_change_of_kind_starts_over():
    s = w.observe({}, [h()], {0: 0.0}, True, False, 0.0)
    s = w.observe(s, [h()], {0: 0.0}, True, False, 100.0)
    assert s == {"0:100": (w.IDLE, 0.0)}
    assert w.judge(s, [h()], 1799.0, 1800.0) == []
    found = w.judge(s, [h()], 1800.0, 1800.0)
    assert [(x.pid, x.kind, x.for_s) for x in found] == [(100, w.IDLE, 1800.0)]
    s = w.observe(s, [h(exists=False)], {0: 0.0}, True, False, 1900.0)  # it died: dead from now
    assert s == {"0:100": (w.DEAD, 1900.0)}
    assert w.observe(s, [h()], {0: 90.0}, True, False, 2000.0) == {}    # its GPU works again: over


def test_the_biggest_first_and_what_frees_each():
    s = {"0:1": (w.IDLE, 0.0), "1:2": (w.DEAD, 0.0), "0:3": (w.NOT_VISIBLE, 0.0)}
    hs = [h(1, 10 * GIB), h(2, 70 * GIB, g=1), h(3, 20 * GIB)]
    found = w.judge(s, hs, 4000.0, 1800.0)
    assert [x.pid for x in found] == [2, 3, 1]
    assert "nvidia-smi --gpu-reset -i 1" in w.free_with(found[0]) and found[0].actionable
    assert "nothing is done about it here" in w.free_with(found[1]) and not found[1].actionable
    assert w.free_with(found[2]).startswith("kill 1")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare is not installed")
def test_a_pid_namespace_of_its_own_is_told_apart(tmp_path):
    """In a real PID namespace the host's NVML PIDs are not ours: never looked up, never 'dead'."""
    code = "from supervisor.gpu.wastewatch import host_pid_namespace as f; print(f())"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))})
    if r.returncode != 0 and r.stderr.startswith("unshare:"):
        pytest.skip(f"no PID namespace with its own /proc here (a chroot?): {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert isinstance(host_pid_namespace(), bool)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_memory_held_for_nothing_is_named_never_activity_and_stops_the_machine_when_asked(
        tmp_path, make_daemon, smtp_server, fake_nvml, s3_server, s3_prefix):
    HFWriter(tmp_path / "out").checkpoint(10)
    fake_nvml.write([gpu(util=0), gpu(util=0)])  # two GPUs from the start (NVML's count is read once)
    kernel = subprocess.Popen(["sleep", "600"])  # a forgotten notebook kernel, as far as NVML can tell
    try:
        d = make_daemon(config(tmp_path, s3_server, s3_prefix, smtp_server, fake_nvml,
                               training={"command": "sleep 600", "on_finish": "none"},
                               idle={"warn_after": "2h", "count_ssh": False},
                               gpu={"waste_after": "2s", "on_waste": "stop"}))
        d.req("start")
        job = d.wait_training("RUNNING")["pid"]
        # GPU 0: the training; GPU 1: 60 GiB held by the stray process at 0 %
        fake_nvml.write([gpu(util=90, procs=[(job, 20 * GIB)]), gpu(util=0, procs=[(kernel.pid, 60 * GIB)])])

        def named() -> dict | None:
            found = d.status()["gpu_waste"]
            return found[0] if found else None
        try:
            x = wait_until(named, 30, what="the stray process named as waste")
        except AssertionError:
            raise AssertionError(str(d.status()["gpus"]) + d.log_text()[-3000:]) from None

        assert (x["gpu"], x["pid"], x["kind"], x["mem_bytes"]) == (1, kernel.pid, "idle", 60 * GIB)
        assert x["user"] and "sleep 600" in x["command"] and x["free_with"].startswith(f"kill {kernel.pid}")
        alert = next(a for a in d.status()["alerts"] if a["kind"] == "gpu_waste")
        assert f"GPU 1: 60.0 GiB held by PID {kernel.pid}" in alert["subject"] and "at 0 % utilization" in alert["subject"]
        assert d.status()["idle"]["state"] == "ACTIVE"  # the training works on GPU 0
        assert not lines(tmp_path / "stopped.txt")        # no waste stop while a training runs

        kernel.kill()
        kernel.wait(10)
        wait_until(lambda: (named() or {}).get("kind") == "dead", 30, what="the dead PID told as dead")
        assert "nvidia-smi --gpu-reset -i 1" in named()["free_with"]

        # the training ends; the memory does not count as activity, and the waste stop comes first
        d.req("stop")
        d.wait_training("STOPPED")
        fake_nvml.write([gpu(util=0), gpu(util=0, procs=[(kernel.pid, 60 * GIB)])])
        # 60 GiB held, yet idle: memory is never activity
        wait_idle(d, lambda i: i["state"] in ("IDLE", "STOPPING", "STOPPED"), what="idle with the memory held")
        wait_until(lambda: lines(tmp_path / "stopped.txt"), 60, what="the waste stop's action")
        st = d.status()
        assert st["stop"]["reason"] == "waste" and st["stop"]["final_sync"]["ok"], st["stop"]
        assert lines(tmp_path / "stopped.txt") == ["stopped"]
        wait_idle(d, lambda i: i["state"] == "STOPPED", what="STOPPED")
    finally:
        if kernel.poll() is None:
            kernel.kill()
