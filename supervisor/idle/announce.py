"""What the idle guard tells the owner: the idle warning, a cancelled stop, the run's end. The stop's
own mails (stopping now, a final sync that holds it, a machine still up) are stop/announce.py's. The
guard gathers the facts; the words are in notify/mails/ (idle.py, training.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import structlog

from supervisor.idle import machine as idle
from supervisor.idle.facts import (
    GuardConfig,
    finish_mode,
    last_progress,
    looks_stalled,
    outputs,
    people_here,
    run_end,
)
from supervisor.idle.machine import Now, SendCancelled, SendWarning, Thresholds
from supervisor.idle.shared import GuardState
from supervisor.interfaces import FinalSyncResult, ProgressView, SyncView, TrainingInfo
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails import Mail
from supervisor.notify.mails import idle as words
from supervisor.notify.mails import training as run_words
from supervisor.notify.mails.sync import Unselected
from supervisor.states import IdleState, TrainingState
from supervisor.stop.announce import in_words as _in_words  # noqa: F401 - the name tests have used
from supervisor.stop.announce import plan_of

log = structlog.get_logger("idle")
I = IdleState  # noqa: E741


class Announcer:
    def __init__(self, conf: GuardConfig, th: Thresholds, state: GuardState, alerts: Alerts, sync: SyncView,
                 progress: ProgressView | None, full_at_end: Callable[[list[str]], str] | None = None,
                 run_total: Callable[[], str] | None = None):
        self.conf, self.th, self.st, self.alerts = conf, th, state, alerts
        self.sync = sync
        self.progress = progress
        self.full_at_end = full_at_end  # the disk wing's: did a failed run die of a full disk (its words)
        self.run_total = run_total  # the run's money across its machines, for the finish mail

    def send(self, key: str, kind: str, severity: str, mail: Mail) -> None:
        self.alerts.event(key, kind, severity, mail.subject, mail.body)

    def _stalled(self) -> words.LiveTraining | None:
        info = self.st.info
        if info is None or not looks_stalled(self.st.signals):
            return None
        return words.LiveTraining(info.run_id, info.pid, info.started_at, self.st.signals.training_signs,
                                  self.conf.stop_grace)

    def _run_total(self) -> str:
        try:
            return self.run_total() if self.run_total is not None else ""
        except Exception:  # noqa: BLE001 - the mail goes out without the run's total
            log.exception("run_total_failed")
            return ""

    def cost(self) -> words.IdleCost | None:
        c, price = idle.idle_cost(self.st.m, self.conf.price_per_hour), self.conf.price_per_hour
        return None if c is None or price is None else words.IdleCost(c, self.conf.currency, price)

    def _plan(self) -> words.StopPlan:
        return plan_of(self.conf, self.sync)

    def warning(self, a: SendWarning, now: Now) -> None:
        stop_at = now.wall + a.stop_in_s
        self.send(f"idle:warning:{a.cycle}", "idle_warning", "warning", words.warning(words.IdleWarning(
            a.idle_s, self.st.m.idle_since, stop_at, a.stop_in_s, self._plan(), self.cost(), self._stalled(),
            tuple(self.st.signals.notes()), self._unselected())))
        log.warning("idle_warning_sent", cycle=a.cycle, idle_s=round(a.idle_s), stop_at=stop_at)

    def cancelled(self, a: SendCancelled, now: Now) -> None:
        self.send(f"idle:cancelled:{a.cycle}", "stop_cancelled", "info", words.cancelled(
            words.Cancelled(now.wall, a.reasons, a.during_stop, self.th.warn_after, a.withdrawn)))
        log.info("stop_cancelled_mail", cycle=a.cycle, reasons=list(a.reasons))

    def _unselected(self) -> Unselected:
        """What no include selects, as the sync engine saw it last (the warning names it)."""
        try:
            return Unselected.of(self.sync.status())
        except Exception:  # noqa: BLE001 - the warning goes out without it
            log.exception("sync_status_for_warning_failed")
            return Unselected()

    def finished(self, info: TrainingInfo, r: FinalSyncResult | None, now: Now, mode: str | None = None) -> None:
        m = self.st.m
        ok = info.state == TrainingState.FINISHED
        mode = mode or finish_mode(self.conf.on_finish, info, people_here(self.st.signals))
        nxt = run_words.Next(mode, idle.projection(m, self.th, now.wall)["stop_at"],
                             self.th.finish_grace, self.th.warn_after, self.th.stop_after_warning,
                             stop_under_way=m.state in (I.STOPPING, I.STOPPED), warned=m.state == I.WARNED)
        end = run_end(info, self.conf.training_user)
        if not ok and self.full_at_end is not None:
            try:
                text = self.full_at_end(list(end.log_tail))
            except Exception:  # noqa: BLE001 - the failure mail goes out regardless
                log.exception("disk_full_check_failed")
                text = ""
            if text:
                end = replace(end, cause="disk full", cause_text=text)
        mail = run_words.ended(run_words.Ended(end, last_progress(self.progress, now.wall, self.conf.currency),
                                               outputs(self.conf, r), nxt, self._run_total()))
        self.send(f"training:end:{info.run_id}:{int(info.ended_at or now.wall)}",
                  "training_finished" if ok else "training_failed", "info" if ok else "warning", mail)
