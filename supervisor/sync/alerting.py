"""The "sync failing" alert: fired once the target has been failing for `sync.fail_alert_after`
(Alerts repeats and dedups it), resolved when an upload gets through again."""

from __future__ import annotations

from typing import Protocol

from ..mails.sync import sync_failing
from ._log import get_logger

log = get_logger("sync")

ALERT_KEY = "sync:failing"


class AlertSink(Protocol):
    def fire(self, key: str, kind: str, severity: str, subject: str, body: str) -> None: ...

    def resolve(self, key: str) -> None: ...


class FailingAlert:
    def __init__(self, alerts: AlertSink | None, target: str, after_s: float):
        self.alerts = alerts   # None: nowhere (a one-shot run: its failure is its exit status)
        self.target = target
        self.after_s = after_s
        self.fired = False

    def due(self, failing_for: float | None) -> bool:
        return self.alerts is not None and failing_for is not None and failing_for >= self.after_s

    def fire(self, failing_for: float, last_error: str, pending_files: int, pending_bytes: int) -> None:
        if self.alerts is None:
            return
        self.fired = True
        mail = sync_failing(self.target, failing_for, last_error, pending_files, pending_bytes)
        try:
            self.alerts.fire(ALERT_KEY, "sync_failing", "warning", mail.subject, mail.body)
        except Exception:  # noqa: BLE001 - alerting must never stop the sync
            log.exception("sync_alert_fire_failed")

    def resolve(self) -> None:
        if not self.fired or self.alerts is None:
            return
        self.fired = False
        try:
            self.alerts.resolve(ALERT_KEY)
        except Exception:  # noqa: BLE001 - alerting must never stop the sync
            log.exception("sync_alert_resolve_failed")
