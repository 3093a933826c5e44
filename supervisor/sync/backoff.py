"""Retrying a failing target: exponential backoff with jitter, and how long it has been failing.
Pure: `now` (monotonic seconds) and the jitter draw come from the caller."""

from __future__ import annotations

from dataclasses import dataclass

BASE_S = 2.0
MAX_DOUBLINGS = 20
RETRY_AFTER_MAX_S = 6 * 3600.0


def delay(failures: int, cap: float, jitter: float) -> float:
    """Seconds before the next try after `failures` failures in a row (1 = the first): 2 s, 4 s,
    8 s ... up to `cap`, times `jitter` (drawn from [0.5, 1.0]) so many machines behind one
    store do not retry in step."""
    return min(cap, BASE_S * 2 ** min(max(failures, 1) - 1, MAX_DOUBLINGS)) * jitter


@dataclass
class Backoff:
    failures: int = 0
    since: float | None = None   # when the current run of failures began; None while healthy
    next_try: float = 0.0
    asked: bool = False          # retry_now came while a try was under way: its failure retries at once

    @property
    def failing(self) -> bool:
        return self.since is not None

    def failed(self, now: float, cap: float, jitter: float, retry_after: float | None = None) -> float:
        """One more failure at `now`; returns the seconds until the next try. `retry_after`: the
        target said when to come back (HTTP 429 Retry-After); never sooner than that, even past
        `cap` (up to RETRY_AFTER_MAX_S: a bogus header must not park uploads for days)."""
        self.failures += 1
        if self.since is None:
            self.since = now
        d = delay(self.failures, cap, jitter)
        if retry_after is not None and retry_after > 0:
            d = max(d, min(retry_after, RETRY_AFTER_MAX_S))
        elif self.asked:
            # the owner asked (or new keys came) after this try began: the try that failed is not the
            # one asked for, so the next one goes at once instead of swallowing the request. Not past a
            # target's Retry-After: that is the target's word
            d = 0.0
        self.asked = False
        self.next_try = now + d
        return d

    def recovered(self, now: float) -> float | None:
        """Healthy again; returns how long it had been failing (None when it was not)."""
        was = None if self.since is None else now - self.since
        self.failures, self.since, self.asked = 0, None, False
        return was

    def retry_now(self) -> None:
        """The user asked: try at once, whatever the backoff said; asked while a try is under way,
        the try after it (see `failed`)."""
        self.next_try = 0.0
        self.asked = True

    def begin_try(self) -> None:
        """A try starts: it answers every request made before it."""
        self.asked = False

    def waiting(self, now: float) -> bool:
        """Failing and the next try is not due yet."""
        return self.since is not None and now < self.next_try

    def due(self, now: float) -> bool:
        """Failing and the next try is due."""
        return self.since is not None and now >= self.next_try

    def failing_for(self, now: float) -> float | None:
        return None if self.since is None else now - self.since

    def retry_in(self, now: float) -> float | None:
        return None if self.since is None else max(0.0, self.next_try - now)
