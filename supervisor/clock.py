"""Time, injected. Every decision takes `now` from a Clock so tests can run hours in microseconds.

Boot identity lives here too: the monotonic clock is only comparable within one boot, so whoever
measures across daemon restarts needs to know which boot a reading came from."""

from __future__ import annotations

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


def read_boot() -> tuple[str, float]:
    """(boot id, seconds since boot), read now."""
    try:
        up = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        up = 0.0
    return boot_id() or UNKNOWN_BOOT, up


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
