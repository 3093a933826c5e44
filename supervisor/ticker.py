"""Periodic duties, each on a thread of its own that sleeps until its next turn.

What the daemon needs from a scheduler and no more: a fixed rate per duty (turns at start +
k x interval, on the monotonic clock), one run of a duty at a time (a slow one skips the turns it
overran instead of piling them up), and a slow duty (a mail to a dead server) delaying none of the
others. Compared with a scheduler thread handing jobs to a pool, each turn costs one wakeup
instead of two hand-offs, which is most of what a daemon at rest spends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Ticker:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._duties: list[tuple[str, float, Callable[[], None], float]] = []
        self._threads: list[threading.Thread] = []

    def add(self, name: str, seconds: float, fn: Callable[[], None], first_in: float = 0.1) -> None:
        """fn every `seconds` (first run `first_in` seconds after start); fn handles its own errors."""
        self._duties.append((name, seconds, fn, first_in))

    def start(self) -> None:
        for name, seconds, fn, first_in in self._duties:
            t = threading.Thread(target=self._loop, args=(seconds, fn, first_in), name=f"duty-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, seconds: float, fn: Callable[[], None], first_in: float) -> None:
        due = time.monotonic() + first_in
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            fn()
            due += seconds
            now = time.monotonic()
            if due < now:  # overran: the missed turns collapse into one, right away
                due = now

    def shutdown(self) -> None:
        self._stop.set()
