"""Wait on a condition with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(fn: Callable[[], T], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or fn}; last value {last!r}")
        time.sleep(interval)
