"""The target's health: backoff while it fails, the last success, and the "sync failing" alert
(fired once the target has been failing for `sync.fail_alert_after`; Alerts repeats and dedups it;
resolved when an upload gets through again).

Two failures are told apart: a rate limit (RateLimited, HTTP 429) is waited out for at least its
Retry-After and alerts only when it lasts, like any failure; refused credentials (AccessDenied,
HTTP 401/403) alert at once under the same key, naming what is wrong: no retry fixes them."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

from supervisor.notify.mails.sync import sync_failing, sync_no_credentials, sync_public_refused, sync_refused
from supervisor.states import SyncState
from supervisor.sync._log import get_logger
from supervisor.sync.backoff import Backoff
from supervisor.sync.status import Board
from supervisor.sync.targets.base import AccessDenied, NoCredentials, PublicRepoRefused, RateLimited

if TYPE_CHECKING:
    from supervisor.clock import Clock

log = get_logger("sync")

ALERT_KEY = "sync:failing"


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
    active = getattr(alerts, "active", None)
    if not callable(active):
        return False
    try:
        return any(a.get("key") == ALERT_KEY for a in active())
    except Exception:  # noqa: BLE001 - alerting must never stop the sync
        return False
