"""Callers that wait for the sync worker's answer: `supervisorctl sync --wait` (wait_idle) and the
stop's final sync. Each caller opens a ticket and blocks on its future; the worker settles tickets
when their condition is met, and settles every open one when it ends, so no caller waits on a
worker that is gone. No polling: a caller wakes when its answer is there or its time is up."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Generic, TypeVar

S = TypeVar("S")  # what the caller asked for
R = TypeVar("R")  # the answer


@dataclass(eq=False)
class Ticket(Generic[S, R]):
    spec: S
    future: Future = field(default_factory=Future)


class Waiters(Generic[S, R]):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[Ticket[S, R]] = []
        self._closed: Callable[[Ticket[S, R]], R] | None = None

    def open(self, spec: S) -> Ticket[S, R]:
        """A new ticket; settled at once when the worker has already ended."""
        t: Ticket[S, R] = Ticket(spec)
        with self._lock:
            closed = self._closed
            if closed is None:
                self._open.append(t)
        if closed is not None:
            t.future.set_result(closed(t))
        return t

    def tickets(self) -> list[Ticket[S, R]]:
        with self._lock:
            return list(self._open)

    def settle(self, t: Ticket[S, R], result: R) -> bool:
        """Answer one caller; False when it was answered (or gave up) already."""
        with self._lock:
            if t not in self._open:
                return False
            self._open.remove(t)
        t.future.set_result(result)
        return True

    def close(self, result: Callable[[Ticket[S, R]], R]) -> None:
        """The worker ends: answer every open ticket, and every later one at once."""
        with self._lock:
            self._closed = result
            left, self._open = self._open, []
        for t in left:
            t.future.set_result(result(t))

    def wait(self, t: Ticket[S, R], timeout: float) -> R | None:
        """The answer, or None when `timeout` (real seconds) passed first; the ticket is then
        withdrawn so the worker no longer works for it."""
        try:
            return t.future.result(max(0.0, timeout))
        except FutureTimeout:
            with self._lock:
                if t in self._open:
                    self._open.remove(t)
                    return None
            return t.future.result()  # settled in the same instant: take the answer
