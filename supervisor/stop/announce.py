"""What the stop tells the owner: the "stopping now" mail (its reason in the rule table's words, the
asking wing's sentence, every other reason that stood and is served by it), a final sync or output
no include selects that holds the stop, a machine still up after its action. The words are in
notify/mails/idle.py; the idle warning, a cancelled stop and a run's end are the idle wing's."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.interfaces import FinalSyncResult, SyncView
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails import Mail
from supervisor.notify.mails import idle as words
from supervisor.notify.mails.sync import Unselected
from supervisor.stop.actions import describe_action
from supervisor.stop.record import StopRecord
from supervisor.stop.rules import StopReason, is_cap, stop_reason, stop_rule

if TYPE_CHECKING:
    from supervisor.stop.views import At, Settings, Shared

log = structlog.get_logger("idle")


def plan_of(conf: Settings, sync: SyncView) -> words.StopPlan:
    """What a stop does here, for every mail that announces one: the folders, the target, the action."""
    target = getattr(sync, "display", "") or conf.sync_target
    return words.StopPlan(conf.final_paths, target, describe_action(conf.stop, conf.stop_plan))


def in_words(word: str) -> str:
    """The stop mail's reason, from the rule table; "" for idleness (the mail says for how long)."""
    return "" if stop_reason(word) == StopReason.IDLE else stop_rule(word).words


class StopAnnouncer:
    def __init__(self, conf: Settings, state: Shared, alerts: Alerts, sync: SyncView,
                 cost: Callable[[], words.IdleCost | None]):
        self.conf, self.st, self.alerts, self.sync = conf, state, alerts, sync
        self.cost = cost  # the idle wing's: what the machine cost while idle, for the mails

    def send(self, key: str, kind: str, severity: str, mail: Mail) -> None:
        self.alerts.event(key, kind, severity, mail.subject, mail.body)

    def plan(self) -> words.StopPlan:
        return plan_of(self.conf, self.sync)

    def sync_failed(self, r: FinalSyncResult) -> None:
        mail = words.sync_failed(words.SyncFailed(self.st.m.stop_reason, self.plan(), r.error, tuple(r.unsynced),
                                                  self.conf.stop.retry_interval, self.cost()))
        self.alerts.fire("stop:failing", "stop_failed", "critical", mail.subject, mail.body)
        log.error("final_sync_failed_not_stopping", error=r.error, unsynced=len(r.unsynced))

    def unselected_held(self, r: FinalSyncResult) -> None:
        """The stop waits: a checkpoint no include selects is newer than anything on the target."""
        left = Unselected(tuple(r.unselected), r.unselected_files, r.unselected_bytes, r.unselected_hold)
        mail = words.unselected_held(words.UnselectedHeld(self.st.m.stop_reason, self.plan(), left,
                                                          self.conf.stop.retry_interval, self.cost()))
        self.alerts.fire("stop:failing", "stop_failed", "critical", mail.subject, mail.body)
        log.error("stop_held_unselected_output", files=r.unselected_files, names=r.unselected[:5])

    def stopping(self, rec: StopRecord, now: At) -> None:
        m = self.st.m
        why = next((x.why for x in m.standing if x.word == rec.reason), "")
        interrupted = None
        if rec.interrupted_run and rec.interrupted_at is not None:
            interrupted = words.Interrupted(rec.interrupted_run, rec.interrupted_at, rec.interrupt_ended,
                                            self.conf.interrupt_patience)
        self.send(f"stop:now:{rec.id}", "stopping", "warning", words.stopping(words.Stopping(
            now.wall, rec.reason == "finished", m.idle_s, rec.synced or {}, rec.forced, self.plan(),
            self.cost(), interrupted, reason=in_words(rec.reason),
            cap=(why or stop_rule(rec.reason).words) if is_cap(rec.reason) else "",
            also=tuple(f"{stop_rule(x.word).words}{': ' + x.why if x.why else ''}"
                       for x in m.standing if x.word != rec.reason),
            why=why)))

    def still_up(self, rec: StopRecord, up_for: float) -> None:
        self.send(f"stop:still-up:{rec.id}", "stop_failed", "critical", words.still_up(up_for, rec.result))
