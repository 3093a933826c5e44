"""The target's health: backoff while it fails, the last success, and the "sync failing" alert
(fired once the target has been failing for `sync.fail_alert_after`; Alerts repeats and dedups it;
resolved when an upload gets through again).

Two failures are told apart: a rate limit (RateLimited, HTTP 429) is waited out for at least its
Retry-After and alerts only when it lasts, like any failure; refused credentials (AccessDenied,
HTTP 401/403) alert at once under the same key, naming what is wrong: no retry fixes them.

A target that answers can still be stale: `Behind` says when a unit here has been saved more than
BEHIND_SAVES times since the version the target holds (a file rewritten faster than it uploads; the
saves are counted in saves.counts.Saves), in status (`target_behind`) and as an alert per unit, resolved
once the target holds the newest save."""

from __future__ import annotations

import random
import threading
from typing import TYPE_CHECKING, Protocol

from supervisor.notify.mails.sync import (
    sync_failing,
    sync_no_credentials,
    sync_public_refused,
    sync_refused,
    target_behind,
)
from supervisor.saves.counts import (
    Lag as Lag,  # one unit's saves here against the target's (counted in saves)
)
from supervisor.states import SyncState
from supervisor.store._log import get_logger
from supervisor.store.base import AccessDenied, NoCredentials, PublicRepoRefused, RateLimited
from supervisor.sync.backoff import Backoff
from supervisor.sync.status import Board

if TYPE_CHECKING:
    from supervisor.clock import Clock

log = get_logger("sync")

ALERT_KEY = "sync:failing"
BEHIND_KEY = "sync:behind:"   # + the unit's key: one alert per unit the target is behind on
BEHIND_SAVES = 2              # more saves than this since the target's version: said and alerted


class AlertSink(Protocol):
    def fire(self, key: str, kind: str, severity: str, subject: str, body: str) -> None: ...

    def resolve(self, key: str) -> None: ...


class Health:
    def __init__(self, board: Board, clock: Clock, alerts: AlertSink | None, target: str,
                 retry_max_backoff: float, fail_alert_after: float):
        self.board = board
        self.clock = clock
        self.alerts = alerts   # None: nowhere (a one-shot run: its failure is its exit status)
        self.target = target
        self.cap = retry_max_backoff
        self.alert_after = fail_alert_after
        self.backoff = Backoff()
        # an alert a previous daemon raised (alerts persist across restarts) is this one's to resolve
        self.fired = _still_active(alerts)
        self.refused = ""      # the target's words while it refuses our credentials
        self.public = False    # ... because the repo is public (sync.hf_allow_public not set)
        self.missing = False   # ... because no credentials were found at all
        self._counted = False  # this try's failure is in the backoff already (begin_try)

    @property
    def failing(self) -> bool:
        return self.backoff.failing

    def failed(self, error: str, cause: BaseException | None = None) -> None:
        """An attempt failed: back off (with jitter; at least the target's Retry-After) and show
        FAILING with the error."""
        now = self.clock.monotonic()
        retry_after = cause.retry_after if isinstance(cause, RateLimited) else None
        with self.board.lock:
            self.refused = error if isinstance(cause, AccessDenied) else ""
            self.public = isinstance(cause, PublicRepoRefused)
            self.missing = isinstance(cause, NoCredentials)
            if self._counted:  # the probe and the pass of one try fail once, not twice
                delay = max(0.0, self.backoff.next_try - now)
            else:
                delay = self.backoff.failed(now, self.cap, random.uniform(0.5, 1.0), retry_after)
                self._counted = True
            self.board.current = ""
            self.board.move(SyncState.FAILING, failing=True)
        self.board.error(error, self.clock.time())
        log.warning("sync_failed", target=self.target, error=error, failures=self.backoff.failures,
                    retry_in_s=round(delay, 1), rate_limited=retry_after is not None or None,
                    refused=bool(self.refused) or None)

    def begin_try(self) -> None:
        self._counted = False
        with self.board.lock:
            self.backoff.begin_try()

    def recovered(self, contacted: bool = True) -> None:
        """The target answered (contacted) or nothing is left that could fail."""
        with self.board.lock:
            self.refused = ""
            was = self.backoff.recovered(self.clock.monotonic())
            if contacted:
                self.board.last_ok_at = self.clock.time()
            if self.board.state == SyncState.FAILING:
                self.board.move(SyncState.IDLE, failing=False)
        if was is not None:
            log.info("sync_recovered", target=self.target, after_s=round(was, 1))
        if self.fired and self.alerts is not None:
            self.fired = False
            try:
                self.alerts.resolve(ALERT_KEY)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_resolve_failed")

    @property
    def alerted(self) -> bool:
        """The "sync failing" alert is out (this daemon's or an earlier one's)."""
        return self.fired

    def evaluate_alert(self) -> None:
        if self.alerts is None:
            return
        with self.board.lock:
            failing_for = self.backoff.failing_for(self.clock.monotonic())
            if failing_for is None or (failing_for < self.alert_after and not self.refused):
                return
            p, err = self.board.pending, self.board.last_error
            self.fired = True
        if self.refused:  # no retry fixes credentials: say so at once, and say which
            words = sync_public_refused if self.public else sync_no_credentials if self.missing else sync_refused
            mail = words(self.target, self.refused, p.files, p.bytes)
        else:
            mail = sync_failing(self.target, failing_for, err, p.files, p.bytes)
        try:
            self.alerts.fire(ALERT_KEY, "sync_failing", "warning", mail.subject, mail.body)
        except Exception:  # noqa: BLE001 - alerting must never stop the sync
            log.exception("sync_alert_fire_failed")


def _still_active(alerts: AlertSink | None) -> bool:
    return ALERT_KEY in _active_keys(alerts)


# --- a target behind the saves ----------------------------------------------------------------------

def behind_alerting(saves: int, was: bool) -> bool:
    """More than BEHIND_SAVES saves behind raises it; once raised it holds until the target has the
    newest save (0 behind), so a writer that keeps pace by a save or two does not make it flap."""
    return saves > BEHIND_SAVES or (was and saves > 0)


class Behind:
    """status's `target_behind` and the "target behind" alerts, from Saves' counts (called by the
    sync worker after a scan and by the inotify thread when it counts a save: hence the lock)."""

    def __init__(self, board: Board, alerts: AlertSink | None, target: str):
        self.board = board
        self.alerts = alerts
        self.target = target
        self._lock = threading.Lock()
        # alerts persist across restarts: an earlier daemon's are this one's to resolve
        self.on: set[str] = {k[len(BEHIND_KEY):] for k in _active_keys(alerts) if k.startswith(BEHIND_KEY)}

    def update(self, lags: list[Lag], alive: set[str]) -> None:
        """`lags`: every unit counted; `alive`: the units the last scan found (an alert for one gone
        is resolved: nothing is left here to be behind on)."""
        with self._lock:
            shown: list[Lag] = []
            resolve: list[str] = []
            for lag in lags:
                if behind_alerting(lag.saves, lag.unit in self.on):
                    shown.append(lag)
                    self.on.add(lag.unit)
                elif lag.unit in self.on:
                    resolve.append(lag.unit)
                    self.on.discard(lag.unit)
            for unit in [u for u in self.on if u not in alive]:
                resolve.append(unit)
                self.on.discard(unit)
            shown.sort(key=lambda g: -g.saves)
        with self.board.lock:
            self.board.behind = [{"unit": g.unit, "path": g.path, "saves": g.saves, "since": g.since,
                                  **({"note": g.note} if g.note else {})} for g in shown]
        if self.alerts is None:
            return
        for g in shown:
            if g.unit not in resolve:
                m = target_behind(self.target, g.path, g.saves, g.since, g.note)
                try:
                    self.alerts.fire(BEHIND_KEY + g.unit, "sync_target_behind", "warning", m.subject, m.body)
                except Exception:  # noqa: BLE001 - alerting must never stop the sync
                    log.exception("sync_alert_fire_failed")
        for unit in resolve:
            try:
                self.alerts.resolve(BEHIND_KEY + unit)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_resolve_failed")


def _active_keys(alerts: AlertSink | None) -> list[str]:
    active = getattr(alerts, "active", None)
    if not callable(active):
        return []
    try:
        return [str(a.get("key")) for a in active()]
    except Exception:  # noqa: BLE001 - alerting must never stop the sync
        return []
