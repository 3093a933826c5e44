"""Time, injected. Every decision takes `now` from a Clock so tests can run hours in microseconds."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch (for display and persisted timestamps)."""

    def monotonic(self) -> float:
        """Seconds that never jump (for measuring intervals within one boot)."""


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock tests move by hand; `jump` moves wall time alone, as NTP does."""

    def __init__(self, start: float = 1_800_000_000.0):
        self._wall = start
        self._mono = 1000.0
        self._lock = threading.Lock()

    def time(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._wall += seconds
            self._mono += seconds

    def jump(self, seconds: float) -> None:
        with self._lock:
            self._wall += seconds
