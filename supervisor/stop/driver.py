"""The stop sequence, run: the interrupt of a live training, the final sync, the stop hooks, the mail,
the action (`stop.json` through record.StopSequence), in a background worker so the scheduler and the
control socket never wait on a final sync.

A stop begins when the stop machine says so (stop/machine.py: `BeginStop`, carried into a new
record here) and ends early when it is cancelled (`AbortStop`: activity, its reason withdrawn, a
higher one taking it over). What each reason does is its row of the rule table (stop.rules): a
reason that `cuts_sync_short` (a money cap, a spot notice) names its moment through the door
(`moment(word)`), and a final sync that hangs is given only the time left to it (or to
`max_idle_cost`); at that moment the stop goes ahead, the mail naming what did not make it off the
machine. Its `interrupt` says how a live training is ended first ("none": the final sync runs beside
it). Required `stop` hooks hold the stop as a failed final sync does.

It works on the record the idle guard keeps (`Shared`: the record, its lock, the clock) and reads
the guard's view of the config (`Settings`); it imports nothing of the idle wing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from supervisor.durations import format_duration
from supervisor.interfaces import FinalSyncResult, SyncView, TrainingInfo, TrainingView
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails import describe_exit
from supervisor.notify.mails import idle as words
from supervisor.states import TRAINING_ALIVE, IdleState, StopPhase, TrainingState
from supervisor.stop import machine as stop
from supervisor.stop.actions import describe_action
from supervisor.stop.announce import StopAnnouncer
from supervisor.stop.finalwatch import EndSync
from supervisor.stop.machine import AbortStop, BeginStop
from supervisor.stop.providers.base import StopActionError
from supervisor.stop.record import StopRecord, StopSequence, may_act_without_sync
from supervisor.stop.rules import HUNG_GRACE_S, is_cap, stop_rule
from supervisor.stop.views import At, Settings, Shared
from supervisor.stop.worker import Jobs

if TYPE_CHECKING:
    from supervisor.hooks.runner import Hooks

log = structlog.get_logger("idle")

I = IdleState  # noqa: E741
P = StopPhase
CUT_FLOOR_S = 1.0         # a final sync is always given at least this long
STILL_UP_AFTER_S = 600.0  # a real stop action "succeeded" but the machine is still here: say so


class StopDriver:
    def __init__(self, conf: Settings, state: Shared, stopper: StopSequence, alerts: Alerts,
                 training: TrainingView, sync: SyncView, announce: StopAnnouncer, jobs: Jobs,
                 poll_soon: Callable[[], None], idle_seconds: Callable[[], float], *, hooks: Hooks | None = None,
                 cap_moment: Callable[[str], tuple[float | None, str]] | None = None, mail_flush_s: float = 30.0):
        self.conf, self.st, self.stopper = conf, state, stopper
        self.clock = state.clock
        self.alerts, self.training, self.sync, self.tell, self.jobs = alerts, training, sync, announce, jobs
        self.poll_soon = poll_soon
        self.idle_seconds = idle_seconds  # the idle wing's: idle seconds as of now (max_idle_cost)
        self.hooks = hooks                # stop and final_sync_done hooks
        # the door's: for a reason that cuts the final sync short, seconds to its moment and its words
        self.cap_moment = cap_moment
        self.mail_flush_s = mail_flush_s
        self.end_sync = EndSync(alerts)   # the final sync at a run's end, failing told at once
        self._queued = False
        self._seen = ""
        self._still_up_alerted = False

    # --- what the stop machine decided (under the record's lock) ---------------------------------
    def carry_out(self, a: BeginStop | AbortStop, now: At) -> None:
        if isinstance(a, BeginStop):
            self.stopper.begin(now.boot_id, a.cycle, a.reason, now.wall)
            self._seen = f"{now.boot_id}:{a.cycle}"
        elif isinstance(a, AbortStop):
            rec = self.stopper.rec
            # withdrawn, not taken over by a higher reason (then the machine is still stopping)
            again = (rec is not None and rec.interrupted_at is not None and rec.done_at is None
                     and stop_rule(rec.reason).resumes_training and self.st.m.state != I.STOPPING)
            self.stopper.cancel(now.wall, a.why or "; ".join(self.st.m.reasons) or "activity")
            self.alerts.resolve("stop:failing")
            if again:  # off the record's lock: a start runs the GPU preflight and may take seconds
                threading.Thread(target=self._resume_training, args=(rec.reason,), name="stop-resume",
                                 daemon=True).start()

    def _resume_training(self, reason: str) -> None:
        """The training this stop interrupted starts again (the table's `resumes_training`: a cap
        moved out of reach); it resumes from its newest checkpoint as any start does."""
        restart = getattr(self.training, "restart", None)
        if restart is None or self.st.m.state == I.STOPPING:  # another stop began meanwhile: it rules
            return
        try:
            restart()
            log.info("stop_withdrawn_training_resumed", reason=reason)
        except Exception as e:  # noqa: BLE001 - a start that fails is told, the stop stays cancelled
            log.warning("stop_withdrawn_training_not_resumed", reason=reason, error=str(e))
            self.alerts.fire(f"stop:resume:{reason}", "training_not_resumed", "warning",
                             f"the training did not start again: {e}",
                             f"The {stop_rule(reason).words} stop was withdrawn after it interrupted the "
                             f"training, and starting it again failed: {e}\nStart it with `supervisorctl start`.")

    # --- each poll --------------------------------------------------------------------------------
    def interrupted(self, info: TrainingInfo) -> bool:
        """This stop interrupted the live run: its signs of life now are its way out, not work."""
        rec = self.stopper.rec
        return (self.st.m.state == I.STOPPING and rec is not None and rec.phase in (P.INTERRUPTING, P.FINAL_SYNC)
                and rec.interrupted_at is not None and rec.interrupted_run == info.run_id)

    def schedule(self, now: At, info: TrainingInfo) -> None:
        """Under the state's lock, at each poll: move the stop on as far as it may go now."""
        st = self.st
        if st.m.state != I.STOPPING or self._queued:
            return
        sid = f"{now.boot_id}:{st.m.cycle}"
        rec = self.stopper.current(now.boot_id)
        if rec is None or rec.id != sid or rec.phase == P.CANCELLED or self._seen != sid:
            # begin() resumes a record this boot's earlier daemon left unfinished
            rec = self.stopper.begin(now.boot_id, st.m.cycle, st.m.stop_reason or "idle", now.wall)
            self._seen = sid
        if rec.phase == P.DONE:
            st.m = stop.stopped(st.m, dry_run=rec.action == "dry-run")
            st.save()
            return
        if rec.phase in (P.INTERRUPTING, P.FINAL_SYNC) and self._interrupts() and not self._training_gone(rec, info, now):
            return  # the final sync waits for the training's end: what it saves on the way out goes up too
        if rec.phase == P.FINAL_SYNC and now.mono < rec.next_try_mono and not self._cap_due():
            return  # the retry waits, unless a cap's moment comes first
        self._queued = True
        self.jobs.submit("stop", self._attempt)

    def check_still_up(self, now: At) -> None:
        rec = self.stopper.current(now.boot_id)
        if self.st.m.state != I.STOPPED or rec is None or rec.action == "dry-run" or rec.done_mono is None:
            return
        if now.mono - rec.done_mono >= STILL_UP_AFTER_S and not self._still_up_alerted:
            self._still_up_alerted = True
            self.tell.still_up(rec, now.mono - rec.done_mono)

    # --- the interrupt ----------------------------------------------------------------------------
    def _training_gone(self, rec: StopRecord, info: TrainingInfo, now: At) -> bool:
        """Interrupt a live training (once per run) and say whether the final sync may begin: no
        training is alive, or the interrupted one outlived SIGINT, SIGTERM and SIGKILL."""
        alive = info.state in TRAINING_ALIVE
        if alive and (rec.interrupted_at is None or rec.interrupted_run != info.run_id):
            self.stopper.interrupting(info.run_id, info.pid, now.wall, now.mono)
            self._stop_training()
            return False
        if rec.phase != P.INTERRUPTING:
            return True  # none alive, or the interrupted one outlived every signal
        waited = now.mono - (rec.interrupted_mono if rec.interrupted_mono is not None else now.mono)
        if alive:
            if info.state != TrainingState.STOPPING:
                self._stop_training()  # a daemon restart came between the record and the signal
            if waited < self._patience():
                return False
            self.stopper.interrupted("", now.wall, f"run {rec.interrupted_run} still alive {format_duration(waited)} "
                                     "after SIGINT, SIGTERM and SIGKILL; the final sync goes ahead")
            log.error("interrupted_training_still_alive", run_id=rec.interrupted_run, waited_s=round(waited))
            return True
        ended = describe_exit(info.exit_code, info.signal)
        self.stopper.interrupted(ended, now.wall, f"run {rec.interrupted_run} ended ({ended}) "
                                                  f"{format_duration(waited)} after the interrupt; final sync next")
        return True

    def _patience(self) -> float:
        return self.conf.patience(min(HUNG_GRACE_S, self.conf.stop_grace) if self._hung() else self.conf.stop_grace)

    def _hung(self) -> bool:
        return stop_rule(self.st.m.stop_reason or "idle").interrupt == "hung"

    def _interrupts(self) -> bool:
        """Does this stop end a live training before its final sync (the table's `interrupt`)?"""
        return stop_rule(self.st.m.stop_reason or "idle").interrupt != "none"

    def _stop_training(self) -> None:
        try:
            if self._hung():
                self.training.stop(grace=HUNG_GRACE_S)
            else:
                self.training.stop()
        except Exception as e:  # noqa: BLE001 - it ended meanwhile; the next poll sees that
            log.warning("training_interrupt_failed", error=str(e))

    # --- the final sync, the hooks, the action (the background worker) --------------------------
    def final_sync(self) -> FinalSyncResult:
        return self.end_sync.final(self.sync, list(self.conf.final_paths), self._sync_timeout())

    def _attempt(self) -> None:
        try:
            self._attempt_inner()
        finally:
            with self.st.lock:
                self._queued = False

    def _attempt_inner(self) -> None:
        st = self.st
        with st.lock:
            rec = self.stopper.rec
            if st.m.state != I.STOPPING or rec is None or rec.phase not in (P.FINAL_SYNC, P.ACTING):
                return
            phase = rec.phase
        if phase == P.FINAL_SYNC:
            if not self._sync_and_announce(rec):
                return
        else:
            with st.lock:
                if not st.m.committed:
                    st.m = stop.commit(st.m)
                    st.save()
        now = st.now()
        try:
            result_text = self.stopper.act(now.wall, now.mono)
        except StopActionError as e:
            with st.lock:
                st.m = stop.failed(st.m)
                st.save()
                mail = words.stop_failed(describe_action(self.conf.stop, self.conf.stop_plan), str(e),
                                         self.conf.stop.retry_interval)
                self.alerts.fire("stop:failing", "stop_failed", "critical", mail.subject, mail.body)
            return
        with st.lock:
            st.m = stop.stopped(st.m, dry_run=rec.action == "dry-run")
            st.save()
        log.warning("machine_stopped", action=rec.action, result=result_text)

    def _sync_and_announce(self, rec: StopRecord) -> bool:
        """The final sync and the stop hooks, then the stopping mail and the commit: True when the
        action may run now, False when the stop waits (a failed sync or hook, activity, a new run)."""
        st = self.st
        why = ""
        result = self.final_sync()
        now = st.now()
        info = self.training_info()
        with st.lock:
            if st.m.state != I.STOPPING or self.stopper.rec is not rec or rec.phase != P.FINAL_SYNC:
                return False  # cancelled by activity while the sync ran
            self.stopper.record_sync(result, now.wall, now.mono)
            if info.state in TRAINING_ALIVE and info.run_id != rec.interrupted_run and self._interrupts():
                return False  # a training started meanwhile: the next poll interrupts it, then syncs again
            if not result.ok and not (why := self._may_force()):
                self.tell.sync_failed(result)
                return False
            if result.ok and result.unselected_hold and not (why := self._may_force()):
                # the only copy of a checkpoint no include selects, newer than anything on the target
                self.stopper.hold(f"{result.unselected_files} files of training output NOT selected for sync",
                                  now.wall, now.mono)
                self.tell.unselected_held(result)
                return False
            if result.ok:
                self.fire("final_sync_done", self._hook_facts(rec, result))
        held = self._stop_hooks_hold(rec)  # outside the lock: a hook may take its whole timeout
        now = st.now()
        with st.lock:
            if st.m.state != I.STOPPING or self.stopper.rec is not rec or rec.phase != P.FINAL_SYNC:
                return False
            if held and not (why := why or self._may_force()):
                self.stopper.hold(held, now.wall, now.mono)
                self.alerts.fire("stop:failing", "stop_failed", "critical", f"stop held: {held[:100]}",
                                 f"{held}\nThe stop waits and tries again in "
                                 f"{format_duration(self.conf.stop.retry_interval)}.\n")
                return False
            if why:
                self.stopper.force(f"{why}{'; ' + held if held else ''}", now.wall)
            self.alerts.resolve("stop:failing")
            if not rec.mailed:
                self.tell.stopping(rec, now)
                self.stopper.mark_mailed()
            st.m = stop.commit(st.m)
            st.save()
        self.alerts.flush(self.mail_flush_s)  # the last words go out before the machine does
        return True

    def training_info(self) -> TrainingInfo:
        try:
            return self.training.info()
        except Exception:  # noqa: BLE001
            log.exception("training_info_failed")
            return TrainingInfo(state=TrainingState.STOPPED)

    # --- caps: the time a final sync may take --------------------------------------------------
    def _cap_left(self) -> tuple[float | None, str]:
        word = self.st.m.stop_reason
        if not is_cap(word) or self.cap_moment is None:
            return None, ""
        try:
            return self.cap_moment(word)
        except Exception:  # noqa: BLE001 - no figure: the configured timeout applies
            log.exception("cap_moment_failed")
            return None, ""

    def _idle_cost_now(self) -> float | None:
        price = self.conf.price_per_hour
        return None if price is None else price * self.idle_seconds() / 3600.0

    def _idle_cost_left(self) -> float | None:
        """Seconds until the idle cost reaches max_idle_cost (None = no such cap)."""
        price, cap, spent = self.conf.price_per_hour, self.conf.max_idle_cost, self._idle_cost_now()
        if not price or cap is None or spent is None:
            return None
        return (cap - spent) / price * 3600.0

    def _sync_timeout(self) -> float:
        """The final sync's time: final_sync_timeout, cut to the moment a cap arrives."""
        lefts = [x for x in (self._cap_left()[0], self._idle_cost_left()) if x is not None]
        return max(CUT_FLOOR_S, min([self.conf.stop.final_sync_timeout, *lefts]))

    def _cap_due(self) -> bool:
        """A cap's moment has come: the stop goes ahead now, whatever held it."""
        left, idle_left = self._cap_left()[0], self._idle_cost_left()
        return (left is not None and left <= CUT_FLOOR_S) or (idle_left is not None and idle_left <= 0)

    def _may_force(self) -> str:
        """Why the stop may go ahead although its final sync or a required hook failed ("" = it may not).
        The idle cost as of now: the sync may have taken long since the last poll."""
        left, what = self._cap_left()
        cap = f"{what} has come" if left is not None and left <= CUT_FLOOR_S else ""
        return may_act_without_sync(self.conf.stop, self._idle_cost_now(), self.conf.max_idle_cost,
                                    self.conf.currency, cap)

    # --- hooks ------------------------------------------------------------------------------------
    def _hook_facts(self, rec: StopRecord | None, r: FinalSyncResult | None = None) -> dict[str, object]:
        synced = (rec.synced if rec is not None else None) or {}
        ok = r.ok if r is not None else synced.get("ok")
        return {"reason": rec.reason if rec is not None else self.st.m.stop_reason,
                "target": (r.target if r is not None else synced.get("target")) or self.conf.sync_target,
                "final_sync_ok": "" if ok is None else str(bool(ok)), "action": self.conf.stop.action,
                "unsynced": " ".join(synced.get("unsynced") or [])[:4000]}

    def fire(self, event: str, facts: dict[str, object]) -> None:
        if self.hooks is not None:
            self.hooks.fire(event, facts)

    def _stop_hooks_hold(self, rec: StopRecord) -> str:
        """Run the `stop` hooks (outside the state's lock); why a required one holds the stop, or ""."""
        if self.hooks is None or not self.hooks.for_event("stop"):
            return ""
        # a cap's moment bounds the hooks too: a hanging hook must not carry the stop past the cap
        results = self.hooks.run_blocking("stop", self._hook_facts(rec), limit=self._sync_timeout())
        bad = [f"`{r.run}` {r.why}" for r in results if r.required and not r.ok]
        return f"required stop hook failed: {'; '.join(bad)}" if bad else ""
