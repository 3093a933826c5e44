"""The sync engine's status board: its state (changed only through `move`), the last success and
error, what is pending, the upload rate. Written by the worker and the target's threads under the
engine's lock; `snapshot` is the `sync` block of `status --json` (plain data)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from supervisor.saves.unselected import NONE, Report
from supervisor.states import SyncState, check_sync_move
from supervisor.sync import unreached
from supervisor.sync.backoff import Backoff
from supervisor.sync.scan import Pending, Unit

RATE_WINDOW_S = 10.0   # the upload rate is measured over this much recent progress
RATE_STALE_S = 5.0     # no progress for this long: the rate is 0 (while uploading) or unknown


class Board:
    def __init__(self, lock: threading.RLock, enabled: bool):
        self.lock = lock
        self.state = SyncState.IDLE if enabled else SyncState.DISABLED
        self._retrying = False          # an upload began while failing: FAILING until a file gets through
        self.last_ok_at: float | None = None
        self.last_error = ""
        self.last_error_at: float | None = None
        self.current = ""
        self.pending = Pending(0, 0, [], [])
        self.partial: list[str] = []
        self.behind: list[dict] = []    # units the target is saves behind on (targethealth.Behind)
        self.unselected: list[str] = []  # training output no include selects (never synced): its names
        self.unselected_report: Report = NONE   # ... counted (saves/unselected.py)
        self._outside = unreached.Outside()     # the folders the walk did not enter, listed at most every 30 s
        self.uploaded_session = 0       # files sent since the engine started
        self.sent = 0                   # bytes sent since the engine started
        self.samples: deque[tuple[float, int]] = deque(maxlen=64)
        self.stats = {"scans": 0, "files_uploaded": 0, "bytes_uploaded": 0, "header_reads": 0}

    def move(self, new: SyncState, failing: bool) -> None:
        """The one place the state changes. While the target is failing, idle and scanning show
        as FAILING: the person reading status must see the failure, not a quiet engine. So does a
        retry's upload until a file gets through (`uploaded`): a try against a down or refusing
        target is no upload, and a word that flips to "uploading" at each retry resets a fleet's
        `sync_state{state="failing"}` alert rule (`for: 10m`) before it fires."""
        with self.lock:
            self._retrying = failing and new == SyncState.UPLOADING
            if failing and new in (SyncState.IDLE, SyncState.SCANNING, SyncState.UPLOADING):
                new = SyncState.FAILING
            check_sync_move(self.state, new)
            self.state = new

    def error(self, text: str, now: float) -> None:
        with self.lock:
            self.last_error = text[:500]
            self.last_error_at = now

    def uploading(self, key: str) -> None:
        with self.lock:
            self.current = key

    def uploaded(self, sent: int) -> None:
        with self.lock:
            if self._retrying and self.state == SyncState.FAILING:  # the target took a file: back
                check_sync_move(self.state, SyncState.UPLOADING)
                self.state = SyncState.UPLOADING
            self._retrying = False
            self.uploaded_session += 1
            self.stats["files_uploaded"] += 1
            self.stats["bytes_uploaded"] += sent

    def progress(self, nbytes: int, now: float) -> None:
        with self.lock:
            self.sent += nbytes
            self.samples.append((now, self.sent))

    def add_partial(self, label: str) -> None:
        with self.lock:
            if label not in self.partial:
                self.partial.append(label)

    def look_unselected(self, walker, units: Iterable[Unit], mono: float, force: bool) -> None:
        """What looks like training output and no include selects, after a scan (outside the engine's
        lock: the folders the walk did not enter are listed here); `force`: a final sync's scan."""
        files, complete = self._outside.files(walker.unreached, walker.policy, mono, force)
        r = unreached.report(walker.seen, files, complete, units, walker.policy)
        with self.lock:
            self.unselected_report, self.unselected = r, list(r.names)

    def snapshot(self, now: float, backoff: Backoff, target: str, totals: tuple[int, int],
                 watch: list[str]) -> dict:
        with self.lock:
            p = self.pending
            return {
                "target": target,
                "state": self.state.value,
                "last_ok_at": self.last_ok_at,
                "last_error": self.last_error,
                "last_error_at": self.last_error_at,
                "pending_bytes": p.bytes,
                "pending_files": p.files,
                "uploaded_files": totals[0],
                "uploaded_bytes": totals[1],
                "current_file": self.current,
                "rate_bps": rate(list(self.samples), now, self.state == SyncState.UPLOADING),
                "failing_for_s": backoff.failing_for(now),
                "next_retry_in_s": backoff.retry_in(now),
                "waiting": [{"unit": u, "reason": r, "format": f or "files",
                             "waiting_for": w or r.removeprefix("waiting for ")} for u, r, f, w in p.waiting[:20]],
                "partial": list(self.partial[:20]),
                "target_behind": list(self.behind[:20]),
                "sent_bytes": self.sent,
                "watch": list(watch),
                "unselected": list(self.unselected[:20]),
                "unselected_files": self.unselected_report.files,
                "unselected_bytes": self.unselected_report.bytes,
                "unselected_items": self.unselected_report.items,
                "unselected_newer": self.unselected_report.hold,
            }


def rate(samples: list[tuple[float, int]], now: float, uploading: bool) -> float | None:
    """Bytes per second over the recent samples of (monotonic time, bytes sent so far)."""
    if len(samples) < 2:
        return None
    if now - samples[-1][0] > RATE_STALE_S:
        return 0.0 if uploading else None
    t0, b0 = samples[0]
    for t, b in samples:
        if now - t <= RATE_WINDOW_S:
            t0, b0 = t, b
            break
    dt = samples[-1][0] - t0
    return (samples[-1][1] - b0) / dt if dt > 0.2 else None
