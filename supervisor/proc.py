"""Facts about one process, read the same way everywhere."""

from __future__ import annotations

import os
import select
from collections.abc import Iterable

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


class ExitWatch:
    """Whether one process, named by (pid, start time), is still alive, asked every second: through
    a pidfd (one poll(2), where start_time reads /proc three times), which names that process and
    can never meet a reused PID. Without pidfds (kernel < 5.3, a seccomp filter) or without a start
    time, start_time is asked each time. An exited process nobody has reaped yet counts as gone."""

    def __init__(self) -> None:
        self._key: tuple[int, float] | None = None
        self._fd: int | None = None

    def alive(self, pid: int | None, started: float | None, tolerance: float = 1.0) -> bool:
        if not pid:
            return False
        if started is None:
            return start_time(pid, zombie_is_gone=True) is not None
        if self._key != (pid, started):
            self.close()
            self._key = (pid, started)
            self._fd = self._open(pid, started, tolerance)
        if self._fd is not None:
            try:
                return not select.select([self._fd], [], [], 0)[0]  # readable once it has exited
            except (OSError, ValueError):
                self._fd = None  # asked the slow way from now on
        now = start_time(pid, zombie_is_gone=True)
        return now is not None and abs(now - started) < tolerance

    @staticmethod
    def _open(pid: int, started: float, tolerance: float) -> int | None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None
        # checked after opening: the fd then holds the process whose start time matched
        now = start_time(pid, zombie_is_gone=True)
        if now is None or abs(now - started) >= tolerance:
            os.close(fd)
            return None
        return fd

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._key = None, None


def descendants(pid: int) -> set[int] | None:
    """Every process under `pid` (children, theirs, ...), from /proc/PID/task/TID/children: a few
    reads per process of the tree, where psutil's children() reads the stat file of every process
    on the machine. None where the kernel has no such file (CONFIG_PROC_CHILDREN off): ask psutil."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue  # gone meanwhile
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            for k in kids:
                if k not in out and k != pid:
                    out.add(k)
                    todo.append(k)
    return out


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(start time since boot, user + system CPU seconds) of `pid` from one read of /proc/PID/stat
    (psutil's Process + cpu_times read it twice, and /proc/stat for the boot time); None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        rest = raw[raw.rfind(b")") + 2:].split()  # state ppid ... utime(14) stime(15) ... starttime(22)
        return int(rest[19]) / _TICKS, (int(rest[11]) + int(rest[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


class CpuProbe:
    """The training's process tree used at least `threshold` % of one core since the last poll: a
    process waiting on nothing uses none, a tokenizer or a data pipeline at work uses a core or more."""

    def __init__(self) -> None:
        self._prev: dict[int, tuple[float, float]] = {}
        self._prev_mono: float | None = None
        self.figure = ""

    def probe(self, pids: Iterable[int], now_mono: float, threshold: float) -> tuple[bool, str]:
        cur: dict[int, tuple[float, float]] = {}
        for pid in pids:
            if (got := _cpu_seconds(pid)) is not None:
                cur[pid] = got
        prev, prev_mono = self._prev, self._prev_mono
        self._prev, self._prev_mono = cur, now_mono
        self.figure = ""
        if prev_mono is None or now_mono - prev_mono <= 0:
            return False, "training cpu: measuring"
        used = 0.0
        for pid, (ctime, total) in cur.items():
            before = prev.get(pid)
            # a process new since the last poll is skipped: its earlier CPU time is not from now
            if before is not None and abs(before[0] - ctime) < 1.0:
                used += max(0.0, total - before[1])
        pct = 100.0 * used / (now_mono - prev_mono)
        self.figure = f"CPU {pct:.0f}%"
        if pct >= threshold:
            return True, f"training cpu: {pct:.0f}% of a core"
        return False, f"training cpu: {pct:.0f}% of a core (below {threshold:g}%)"
