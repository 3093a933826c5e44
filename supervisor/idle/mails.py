"""The idle guard's mails, mixed into IdleGuard: the guard gathers the facts, the words are in
notify/mails/ (idle.py, training.py). Kept apart so the guard itself stays one screenful of duties."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import structlog

from supervisor.idle import machine as idle
from supervisor.idle.facts import finish_mode, last_progress, looks_stalled, outputs, people_here, run_end
from supervisor.idle.machine import CAP_REASONS, Now, SendWarning
from supervisor.idle.stop import StopRecord, describe_action
from supervisor.interfaces import FinalSyncResult, TrainingInfo
from supervisor.notify.mails import Mail
from supervisor.notify.mails import idle as words
from supervisor.notify.mails import training as run_words
from supervisor.states import IdleState, TrainingState, stop_rule

log = structlog.get_logger("idle")
I = IdleState  # noqa: E741


class GuardMails:
    """Needs of the host: conf, alerts, m, th, sync, progress, _signals, _last_info, cap_why."""

    conf: Any
    alerts: Any
    m: Any
    th: Any
    sync: Any
    progress: Any
    _signals: Any
    _last_info: Any
    disk: Any = None   # the disk wing: whether a failed run died of a full disk
    cap_why: str = ""

    def _send(self, key: str, kind: str, severity: str, mail: Mail) -> None:
        self.alerts.event(key, kind, severity, mail.subject, mail.body)

    def _stalled(self) -> words.LiveTraining | None:
        info = self._last_info
        if info is None or not looks_stalled(self._signals):
            return None
        return words.LiveTraining(info.run_id, info.pid, info.started_at, self._signals.training_signs,
                                  self.conf.stop_grace)

    def _idle_cost(self) -> float | None:
        return idle.idle_cost(self.m, self.conf.price_per_hour)

    def _run_total(self) -> str:
        fn = getattr(self, "run_total", None)
        try:
            return fn() if fn is not None else ""
        except Exception:  # noqa: BLE001 - the mail goes out without the run's total
            log.exception("run_total_failed")
            return ""

    def _cost(self) -> words.IdleCost | None:
        c, price = self._idle_cost(), self.conf.price_per_hour
        return None if c is None or price is None else words.IdleCost(c, self.conf.currency, price)

    def _plan(self) -> words.StopPlan:
        target = getattr(self.sync, "display", "") or self.conf.sync_target
        return words.StopPlan(self.conf.final_paths, target, describe_action(self.conf.stop))

    def _mail_warning(self, a: SendWarning, now: Now) -> None:
        stop_at = now.wall + a.stop_in_s
        self._send(f"idle:warning:{a.cycle}", "idle_warning", "warning", words.warning(words.IdleWarning(
            a.idle_s, self.m.idle_since, stop_at, a.stop_in_s, self._plan(), self._cost(), self._stalled(),
            tuple(self._signals.notes()))))
        log.warning("idle_warning_sent", cycle=a.cycle, idle_s=round(a.idle_s), stop_at=stop_at)

    def _alert_sync_failed(self, r: FinalSyncResult) -> None:
        mail = words.sync_failed(words.SyncFailed(self.m.stop_reason, self._plan(), r.error, tuple(r.unsynced),
                                                  self.conf.stop.retry_interval, self._cost()))
        self.alerts.fire("stop:failing", "stop_failed", "critical", mail.subject, mail.body)
        log.error("final_sync_failed_not_stopping", error=r.error, unsynced=len(r.unsynced))

    def _mail_stopping(self, rec: StopRecord, now: Now) -> None:
        interrupted = None
        if rec.interrupted_run and rec.interrupted_at is not None:
            interrupted = words.Interrupted(rec.interrupted_run, rec.interrupted_at, rec.interrupt_ended,
                                            self.conf.interrupt_patience)
        self._send(f"stop:now:{rec.id}", "stopping", "warning", words.stopping(words.Stopping(
            now.wall, rec.reason == "finished", self.m.idle_s, rec.synced or {}, rec.forced, self._plan(),
            self._cost(), interrupted, reason=words.STOP_REASONS.get(rec.reason, ""),
            cap=(self.cap_why or f"the {rec.reason.replace('_', ' ')}") if rec.reason in CAP_REASONS else "",
            also=tuple(f"{stop_rule(x.word).words}{': ' + x.why if x.why else ''}"
                       for x in self.m.standing if x.word != rec.reason),
            why=next((x.why for x in self.m.standing if x.word == rec.reason), ""))))

    def _mail_finished(self, info: TrainingInfo, r: FinalSyncResult | None, now: Now, mode: str | None = None) -> None:
        ok = info.state == TrainingState.FINISHED
        mode = mode or finish_mode(self.conf.on_finish, info, people_here(self._signals))
        nxt = run_words.Next(mode, idle.projection(self.m, self.th, now.wall)["stop_at"],
                             self.th.finish_grace, self.th.warn_after, self.th.stop_after_warning,
                             stop_under_way=self.m.state in (I.STOPPING, I.STOPPED), warned=self.m.state == I.WARNED)
        end = run_end(info, self.conf.training_user)
        if not ok and self.disk is not None:
            try:
                text = self.disk.full_at_end(list(end.log_tail))
            except Exception:  # noqa: BLE001 - the failure mail goes out regardless
                log.exception("disk_full_check_failed")
                text = ""
            if text:
                end = replace(end, cause="disk full", cause_text=text)
        mail = run_words.ended(run_words.Ended(end, last_progress(self.progress, now.wall, self.conf.currency),
                                               outputs(self.conf, r), nxt, self._run_total()))
        self._send(f"training:end:{info.run_id}:{int(info.ended_at or now.wall)}",
                   "training_finished" if ok else "training_failed", "info" if ok else "warning", mail)
