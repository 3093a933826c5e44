"""Facts about one process, read the same way everywhere."""

from __future__ import annotations

import psutil


def start_time(pid: int | None, *, zombie_is_gone: bool = False) -> float | None:
    """When `pid` started (epoch seconds, as psutil reports it), or None when it does not exist.
    A PID with the start time recorded next to it identifies one process even after PID reuse.
    `zombie_is_gone`: an exited process nobody has reaped yet counts as gone (a waited-for command)."""
    if not pid:
        return None
    try:
        p = psutil.Process(pid)
        if zombie_is_gone and p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p.create_time()
    except (psutil.Error, ValueError):
        return None


def is_same(pid: int | None, started: float | None, tolerance: float = 0.05) -> bool:
    """The recorded (pid, start time) is still that process, not a reused PID."""
    if not pid or started is None:
        return False
    now = start_time(pid)
    return now is not None and abs(now - started) <= tolerance
