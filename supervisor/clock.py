"""Time, injected. Every decision takes `now` from a Clock so tests can run hours in microseconds.

Boot identity lives here too: the monotonic clock is only comparable within one boot, so whoever
measures across daemon restarts needs to know which boot a reading came from."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Protocol

UNKNOWN_BOOT = "unknown-boot"


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch (for display and persisted timestamps)."""

    def monotonic(self) -> float:
        """Seconds that never jump (for measuring intervals within one boot)."""

    def boot(self) -> tuple[str, float]:
        """(boot id, seconds since boot) of this machine."""


def boot_id() -> str:
    """The kernel's id of this boot ("" when it cannot be read)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def billing_since(uptime: float, pid1_start: float | None) -> tuple[float, str]:
    """(seconds this machine has billed, since what) from CLOCK_BOOTTIME's seconds (`uptime`, which
    a time namespace moves) and when PID 1 of our PID namespace started on that clock: a container
    started an hour ago on a host up for a month has billed one hour. Pure."""
    if pid1_start is None or not 0 < pid1_start <= uptime:
        return uptime, "boot"
    # a host's init starts with the kernel (the seconds between are the firmware's and not billed
    # apart); one that started later is a container's
    return uptime - pid1_start, "container start" if pid1_start >= CONTAINER_AFTER_S else "boot"


CONTAINER_AFTER_S = 120.0   # PID 1 started this long after the kernel: a container's init


def pid1_start() -> float | None:
    """When PID 1 of this PID namespace started, in seconds on CLOCK_BOOTTIME (/proc/1/stat's
    starttime, which the kernel reports in our time namespace); None when unreadable."""
    try:
        raw = Path("/proc/1/stat").read_text()
        fields = raw[raw.rindex(")") + 2:].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def read_boot() -> tuple[str, float]:
    """(boot id, seconds this machine has billed: since the later of the boot and the start of
    PID 1 of our PID namespace), read now. Never /proc/stat's btime: a container counts from its own
    start, whatever the host's uptime."""
    try:
        up = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        up = 0.0
    return boot_id() or UNKNOWN_BOOT, billing_since(up, pid1_start())[0]


def billing_origin() -> str:
    """"boot" or "container start": what read_boot's seconds count from."""
    try:
        up = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "boot"
    return billing_since(up, pid1_start())[1]


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def boot(self) -> tuple[str, float]:
        return read_boot()


class FakeClock:
    """A clock tests move by hand; `jump` moves wall time alone, as NTP does. Its boot is whatever
    the test set last (`set_boot`): a new id is a reboot, and the uptime is what that boot reports."""

    def __init__(self, start: float = 1_800_000_000.0, boot: tuple[str, float] = ("fake-boot", 0.0)):
        self._wall = start
        self._mono = 1000.0
        self._boot = boot
        self._lock = threading.Lock()

    def time(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def boot(self) -> tuple[str, float]:
        with self._lock:
            return self._boot

    def set_boot(self, boot_id: str, uptime: float = 0.0) -> None:
        with self._lock:
            self._boot = (boot_id, uptime)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._wall += seconds
            self._mono += seconds

    def jump(self, seconds: float) -> None:
        with self._lock:
            self._wall += seconds
