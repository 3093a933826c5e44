"""A checkpoint deleted before it left the machine: told at once, naming it and the likely cause.

The Trainer's rotation (`save_total_limit`) deletes the oldest checkpoint at each save, whether it
went up or not; with the target slow, down or refusing our keys, that deletes work that exists
nowhere else. Nothing can bring it back, but the owner must hear it the moment it happens (and
fix the target or raise the limit) instead of finding the gap at the next resume.

`vanished` is pure: the folder units of the previous scan that this scan did not find, that were
not all on the target, and that no rule of ours retired. The shell checks that the folder is
really gone (a scan that could not read it is not a deletion) and alerts once per unit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from supervisor.config.hints import ROTATION
from supervisor.notify.mails.sync import checkpoint_lost, checkpoint_stuck
from supervisor.sync._log import get_logger

if TYPE_CHECKING:
    from supervisor.sync.scan import Unit
    from supervisor.sync.targethealth import AlertSink

log = get_logger("sync")

KEEP = 20  # the units `status --json` lists (the newest losses)


def vanished(before: Mapping[object, Unit], after: Mapping[object, Unit], synced: Callable[[Unit], bool]) -> list[Unit]:
    return [u for k, u in before.items()
            if k not in after and u.kind == "dir" and u.selected and not u.retired and not synced(u)]


def likely_cause(command: str) -> str:
    m = ROTATION.search(command or "")
    if m:
        return (f"the training's --save_total_limit {m.group(1)}: the trainer deletes its oldest checkpoint at "
                f"each save, and more than {m.group(1)} were waiting to go up")
    return ("most likely the trainer's rotation (save_total_limit) deleting its oldest checkpoint while newer "
            "ones still waited to go up, or someone's rm")


class LostWatch:
    def __init__(self, alerts: AlertSink | None, target: str, command: str = ""):
        self.alerts = alerts
        self.target = target
        self.command = command
        self.lost: list[dict] = []
        self._stuck: set[str] = set()

    def look(self, before: Mapping[object, Unit], after: Mapping[object, Unit], synced: Callable[[Unit], bool],
             now: float, target_error: str) -> None:
        for u in vanished(before, after, synced):
            if os.path.lexists(u.abspath):
                continue  # not read this time, not deleted
            size = sum(s.size for s in u.selected)
            cause = likely_cause(self.command)
            self.lost = [{"unit": u.label, "path": u.abspath, "at": now, "files": len(u.selected), "bytes": size},
                         *self.lost][:KEEP]
            log.error("sync_unit_lost", unit=u.label, path=u.abspath, files=len(u.selected), bytes=size, cause=cause)
            if self.alerts is None:
                continue
            mail = checkpoint_lost(u.abspath, self.target, len(u.selected), size, cause, target_error)
            try:
                self.alerts.fire(f"sync:lost:{u.label}", "checkpoint_lost", "critical", mail.subject, mail.body)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_fire_failed")

    def stuck(self, entries: list[tuple[str, str, float]], formats: dict[str, str]) -> None:
        """Units their format's rule keeps waiting on long after the writers went quiet (scan.pending):
        alerted once each, resolved when they complete or go."""
        now = {label for label, _, _ in entries}
        for label, waiting, quiet_for in entries:
            if label in self._stuck or self.alerts is None:
                continue
            self._stuck.add(label)
            log.error("sync_unit_stuck", unit=label, waiting_for=waiting, quiet_for_s=round(quiet_for))
            mail = checkpoint_stuck(label, self.target, waiting, quiet_for, formats.get(label, ""))
            try:
                self.alerts.fire(f"sync:stuck:{label}", "checkpoint_stuck", "warning", mail.subject, mail.body)
            except Exception:  # noqa: BLE001 - alerting must never stop the sync
                log.exception("sync_alert_fire_failed")
        for label in self._stuck - now:
            self._stuck.discard(label)
            if self.alerts is not None:
                try:
                    self.alerts.resolve(f"sync:stuck:{label}")
                except Exception:  # noqa: BLE001
                    log.exception("sync_alert_resolve_failed")
