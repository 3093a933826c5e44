"""A stop signal ends the daemon whichever of its threads the kernel hands it to.

The kernel delivers a process's signal to any thread that does not block it; CPython runs the
Python handler in the main thread only, and a main thread blocked in a lock wait is not woken by a
signal another thread took. The daemon once waited so, and a SIGINT taken by a worker thread left
it running for good (seen on a fresh machine: 90 s, then the test gave up)."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
from pathlib import Path

import pytest

from tests.waiting import wait_until

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


def tgkill(pid: int, tid: int, sig: int) -> None:
    """Send `sig` to one thread of `pid` (os.kill picks no thread: the kernel does)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {pid} {tid}")


@pytest.mark.skipif(SYS_TGKILL is None, reason=f"tgkill's number unknown on {platform.machine()}")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_taken_by_a_worker_thread_still_stops_the_daemon(make_daemon, sig):
    d = make_daemon({"preemption": {"sigterm": "exit"}})
    assert d.status()["daemon"]
    pid = d.proc.pid
    workers = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert workers, "the daemon runs worker threads"
    tgkill(pid, workers[-1], sig)
    wait_until(lambda: d.proc.poll() is not None, 20, interval=0.05,
               what=f"the daemon's exit after {sig.name} to thread {workers[-1]}: {d.log_text()[-800:]}")
    assert d.proc.returncode == 0, d.log_text()[-2000:]
    assert "daemon_stopping" in d.log_text()
    assert Path(f"/proc/{pid}").exists() is False
