"""The stop's one background worker (the final syncs, the hooks, the action): the scheduler and the
control socket never wait on a final sync. The idle guard queues a run's end on it too, so a run's
final sync and a stop's never run at once."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("idle")


class Jobs:
    """One background worker, started on demand, running queued jobs one at a time."""

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._q: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition(lock)
        self._worker: threading.Thread | None = None

    def submit(self, name: str, fn: Callable, *args) -> None:
        with self._lock:
            self._pending += 1
            self._q.put((name, fn, args))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="idle-worker", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._q.empty():
                    self._worker = None
                    return
                name, fn, args = self._q.get()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a failed job is logged; the next poll tries again
                log.exception("idle_job_failed", job=name)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait (real time: real threads run the jobs) until no job is queued or running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True
