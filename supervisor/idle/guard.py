"""IdleGuard: the thin shell around the idle machine. It gathers the probes' signals, steps the
machine, persists it (`idle.json`), sends the mails, and runs the stop sequence (`stop.json`) and
the on-finish handling in a background worker so the scheduler and the control socket never wait
on a final sync. Decisions live in `machine.py` and `stop.py` (the sequence), its config view,
worker and the facts it reports in `facts.py`, words in `notify/mails/idle.py` and `mails/training.py`, status lines in `render.idle_lines`.

The daemon builds one after GPU, sync and training, schedules `poll()` every idle.poll_interval,
calls `on_training_ended(info)` when a run ends, and routes `supervisorctl keepalive` to
`keepalive()` / `cancel_keepalive()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from supervisor.clock import Clock
from supervisor.context import Context
from supervisor.durations import format_duration
from supervisor.idle import machine as idle
from supervisor.idle.activity import Probes
from supervisor.idle.caps import CapStops
from supervisor.idle.facts import GuardConfig, Jobs, finish_mode, people_here, status_of
from supervisor.idle.finalwatch import EndSync
from supervisor.idle.machine import (
    AbortStop,
    BeginStop,
    IdleMachine,
    Now,
    SendCancelled,
    SendWarning,
    Signals,
    Thresholds,
)
from supervisor.idle.mails import GuardMails
from supervisor.idle.stop import (
    StopActionError,
    StopRecord,
    StopSequence,
    describe_action,
)
from supervisor.interfaces import Duty, FinalSyncResult, GpuView, SyncView, TrainingInfo, TrainingView, Verb
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails import describe_exit
from supervisor.notify.mails import idle as words
from supervisor.notify.mails import stall as stall_words
from supervisor.progress import stall
from supervisor.requests import keepalive_seconds
from supervisor.statefile import StateStore
from supervisor.states import HUNG_GRACE_S, TRAINING_ALIVE, IdleState, StopPhase, TrainingState, stop_rule
from supervisor.timefmt import when

log = structlog.get_logger("idle")

I = IdleState  # noqa: E741
P = StopPhase
STILL_UP_AFTER_S = 600.0  # a real stop action "succeeded" but the machine is still here: say so


class IdleGuard(GuardMails, CapStops):
    def __init__(self, conf: GuardConfig, clock: Clock, store: StateStore, alerts: Alerts,
                 training: TrainingView, gpu: GpuView | None, sync: SyncView, progress: Any = None, *,
                 tmux_socket: str | None = None, runners: dict | None = None, env: dict[str, str] | None = None,
                 mail_flush_s: float = 30.0, disk: Any = None, run_total: Callable[[], str] | None = None,
                 hooks: Any = None, cap_moment: Callable[[], tuple[float | None, str]] | None = None):
        self.conf = conf
        self.hooks = hooks                # supervisor.hooks.runner.Hooks: stop and final_sync_done hooks
        self.cap_moment = cap_moment      # the money guard's: seconds to the cap's moment and its words
        self.disk = disk
        self.run_total = run_total  # the run's money across its machines, for the finish mail
        self.clock, self.store, self.alerts = clock, store, alerts
        self.th = Thresholds.of(conf.idle, conf.finish_grace)
        self.training = training
        self.gpu = gpu
        self.sync = sync
        self.progress = progress
        socket = tmux_socket or getattr(getattr(training, "tmux", None), "socket", None) \
            or str(Path(conf.state_dir) / "tmux.sock")
        self.probes = Probes(conf.idle, socket, conf.session, conf.interrupt_patience)
        self.mail_flush_s = mail_flush_s
        self._lock = threading.RLock()
        self.jobs = Jobs(self._lock)
        self.m = self._load()
        self.stopper = StopSequence(conf.stop, store, clock, state_dir=conf.state_dir,
                                    command_env=conf.training_env, runners=runners, env=env)
        self._signals = Signals()
        self._last_info: TrainingInfo | None = None
        self.end_sync = EndSync(alerts)  # the final sync at a run's end, failing told at once
        self._stop_queued = False
        self._stop_seen = ""
        self._finish_queued: int | None = None
        self._still_up_alerted = False
        self._poll_wanted = False

    @classmethod
    def of(cls, ctx: Context, conf: GuardConfig, training: TrainingView, gpu: GpuView | None, sync: SyncView,
           progress: Any = None, **kw: Any) -> IdleGuard:
        """The guard as the daemon wires it: its slice of the config, the shared clock, store and alerts."""
        return cls(conf, ctx.clock, ctx.store, ctx.alerts, training, gpu, sync, progress,
                   **kw)

    # --- persistence ----------------------------------------------------------------------------
    def _load(self) -> IdleMachine:
        raw = self.store.load("idle", None)
        if raw is None:
            return IdleMachine()
        try:
            return IdleMachine.from_dict(raw)
        except ValueError as e:
            # unusable: start over; the idle clock restarts now, it never jumps ahead
            self.store.problems.append(f"idle.json: {e}; the idle clock starts over")
            log.error("idle_state_unusable", error=str(e))
            return IdleMachine()

    def _save(self) -> None:
        try:
            self.store.save("idle", self.m.to_dict())
        except OSError as e:
            log.error("idle_state_save_failed", error=str(e))

    def _now(self) -> Now:
        bid, up = self.clock.boot()
        return Now(self.clock.time(), self.clock.monotonic(), bid, up)

    # --- the poll ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Scheduled every idle.poll_interval. Probes outside the lock; never raises."""
        try:
            now = self._now()
            info = self._info()
            sig = self.probes.gather(info, now, self.gpu, self.training.pids)
            if why := self._stall_counts_idle(info, now):
                sig = idle.people_only(sig, why)
            with self._lock:
                if self._interrupted(info):
                    sig = idle.people_only(sig, "the stop is interrupting the training")
                self._signals, self._last_info = sig, info
                before = self.m.state
                self.m, actions = idle.step(self.m, sig, now, self.th)
                if self.m.state != before:
                    log.info("idle_state", old=before.value, new=self.m.state.value, reasons=self.m.reasons,
                             idle_s=round(self.m.idle_s))
                self._carry_out(actions, now)
                self._save()
                self._reconcile_finish(info, now)
                self._schedule_stop(now, info)
                self._check_still_up(now)
        except Exception:  # noqa: BLE001 - the guard must keep polling
            log.exception("idle_poll_failed")

    def poll_soon(self) -> None:
        """Something the idle judgement depends on just changed (a run started or ended): judge
        again within a second instead of at the next scheduled poll."""
        self._poll_wanted = True

    def poll_if_due(self) -> None:
        """Run every second: polls now when asked to, or when a poll would cross the warning or stop
        threshold, so the times status and the mails announce are the times things happen."""
        with self._lock:
            wanted = self._poll_wanted or idle.due(self.m, self.th, self.clock.monotonic())
            self._poll_wanted = False
        if wanted:
            self.poll()

    def _stall_counts_idle(self, info: TrainingInfo, now: Now) -> str:
        """Why a RUNNING training's signs of life are not work (progress.stalled_action = "stop" and
        its step stands still past the threshold: supervisor.progress.stall); "" when they are."""
        if self.conf.stalled_action != "stop" or self.progress is None or info.state != TrainingState.RUNNING:
            return ""
        try:
            s = self.progress.stall(now.wall).stall
        except Exception:  # noqa: BLE001 - no verdict: the probes alone decide, as without this option
            log.exception("stall_check_failed")
            return ""
        if s is None or not stall.counts_as_idle(s, self.conf.stalled_action):
            return ""
        return stall_words.reason(s.step, s.since, s.for_s)

    def _info(self) -> TrainingInfo:
        try:
            return self.training.info()
        except Exception:  # noqa: BLE001
            log.exception("training_info_failed")
            return TrainingInfo(state=TrainingState.STOPPED)

    def _carry_out(self, actions: list, now: Now) -> None:
        for a in actions:
            if isinstance(a, SendWarning):
                self._mail_warning(a, now)
                self._fire("idle_warning", {"reason": "idle", "idle_s": round(a.idle_s),
                                            "stop_at": round(now.wall + a.stop_in_s), "target": self.conf.sync_target})
            elif isinstance(a, SendCancelled):
                self._send(f"idle:cancelled:{a.cycle}", "stop_cancelled", "info", words.cancelled(
                    words.Cancelled(now.wall, a.reasons, a.during_stop, self.th.warn_after)))
                log.info("stop_cancelled_mail", cycle=a.cycle, reasons=list(a.reasons))
            elif isinstance(a, BeginStop):
                self.stopper.begin(now.boot_id, a.cycle, a.reason, now.wall)
                self._stop_seen = f"{now.boot_id}:{a.cycle}"
            elif isinstance(a, AbortStop):
                self.stopper.cancel(now.wall, "; ".join(self.m.reasons) or "activity")
                self.alerts.resolve("stop:failing")

    # --- the stop sequence ------------------------------------------------------------------------
    def _interrupted(self, info: TrainingInfo) -> bool:
        """This stop interrupted the live run: its signs of life now are its way out, not work."""
        rec = self.stopper.rec
        return (self.m.state == I.STOPPING and rec is not None and rec.phase in (P.INTERRUPTING, P.FINAL_SYNC)
                and rec.interrupted_at is not None and rec.interrupted_run == info.run_id)

    def _schedule_stop(self, now: Now, info: TrainingInfo) -> None:
        if self.m.state != I.STOPPING or self._stop_queued:
            return
        sid = f"{now.boot_id}:{self.m.cycle}"
        rec = self.stopper.current(now.boot_id)
        if rec is None or rec.id != sid or rec.phase == P.CANCELLED or self._stop_seen != sid:
            # begin() resumes a record this boot's earlier daemon left unfinished
            rec = self.stopper.begin(now.boot_id, self.m.cycle, self.m.stop_reason or "idle", now.wall)
            self._stop_seen = sid
        if rec.phase == P.DONE:
            self.m = idle.mark_stopped(self.m, dry_run=rec.action == "dry-run")
            self._save()
            return
        if rec.phase in (P.INTERRUPTING, P.FINAL_SYNC) and not self._training_gone(rec, info, now):
            return  # the final sync waits for the training's end: what it saves on the way out goes up too
        if rec.phase == P.FINAL_SYNC and now.mono < rec.next_try_mono and not self._cap_due():
            return  # the retry waits, unless a cap's moment comes first
        self._stop_queued = True
        self.jobs.submit("stop", self._stop_attempt)

    def _training_gone(self, rec: StopRecord, info: TrainingInfo, now: Now) -> bool:
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
        return stop_rule(self.m.stop_reason or "idle").hung

    def _stop_training(self) -> None:
        try:
            if self._hung():
                self.training.stop(grace=HUNG_GRACE_S)
            else:
                self.training.stop()
        except Exception as e:  # noqa: BLE001 - it ended meanwhile; the next poll sees that
            log.warning("training_interrupt_failed", error=str(e))

    def _final_sync(self) -> FinalSyncResult:
        return self.end_sync.final(self.sync, list(self.conf.final_paths), self._sync_timeout())

    def _stop_attempt(self) -> None:
        try:
            self._stop_attempt_inner()
        finally:
            with self._lock:
                self._stop_queued = False

    def _stop_attempt_inner(self) -> None:
        with self._lock:
            rec = self.stopper.rec
            if self.m.state != I.STOPPING or rec is None or rec.phase not in (P.FINAL_SYNC, P.ACTING):
                return
            phase = rec.phase
        if phase == P.FINAL_SYNC:
            why = ""
            result = self._final_sync()
            now = self._now()
            info = self._info()
            with self._lock:
                if self.m.state != I.STOPPING or self.stopper.rec is not rec or rec.phase != P.FINAL_SYNC:
                    return  # cancelled by activity while the sync ran
                self.stopper.record_sync(result, now.wall, now.mono)
                if info.state in TRAINING_ALIVE and info.run_id != rec.interrupted_run:
                    return  # a training started meanwhile: the next poll interrupts it, then syncs again
                if not result.ok and not (why := self._may_force()):
                    self._alert_sync_failed(result)
                    return
                if result.ok:
                    self._fire("final_sync_done", self._hook_facts(rec, result))
            held = self._stop_hooks_hold(rec)  # outside the lock: a hook may take its whole timeout
            now = self._now()
            with self._lock:
                if self.m.state != I.STOPPING or self.stopper.rec is not rec or rec.phase != P.FINAL_SYNC:
                    return
                if held and not (why := why or self._may_force()):
                    self.stopper.hold(held, now.wall, now.mono)
                    self.alerts.fire("stop:failing", "stop_failed", "critical", f"stop held: {held[:100]}",
                                     f"{held}\nThe stop waits and tries again in "
                                     f"{format_duration(self.conf.stop.retry_interval)}.\n")
                    return
                if why:
                    self.stopper.force(f"{why}{'; ' + held if held else ''}", now.wall)
                self.alerts.resolve("stop:failing")
                if not rec.mailed:
                    self._mail_stopping(rec, now)
                    self.stopper.mark_mailed()
                self.m = idle.commit_stop(self.m)
                self._save()
            self.alerts.flush(self.mail_flush_s)  # the last words go out before the machine does
        else:
            with self._lock:
                if not self.m.committed:
                    self.m = idle.commit_stop(self.m)
                    self._save()
        now = self._now()
        try:
            result_text = self.stopper.act(now.wall, now.mono)
        except StopActionError as e:
            with self._lock:
                self.m = idle.stop_failed(self.m)
                self._save()
                mail = words.stop_failed(describe_action(self.conf.stop), str(e), self.conf.stop.retry_interval)
                self.alerts.fire("stop:failing", "stop_failed", "critical", mail.subject, mail.body)
            return
        with self._lock:
            self.m = idle.mark_stopped(self.m, dry_run=rec.action == "dry-run")
            self._save()
        log.warning("machine_stopped", action=rec.action, result=result_text)

    def _check_still_up(self, now: Now) -> None:
        rec = self.stopper.current(now.boot_id)
        if self.m.state != I.STOPPED or rec is None or rec.action == "dry-run" or rec.done_mono is None:
            return
        if now.mono - rec.done_mono >= STILL_UP_AFTER_S and not self._still_up_alerted:
            self._still_up_alerted = True
            self._send(f"stop:still-up:{rec.id}", "stop_failed", "critical",
                       words.still_up(now.mono - rec.done_mono, rec.result))

    # --- training ended ---------------------------------------------------------------------------
    def on_training_ended(self, info: TrainingInfo) -> None:
        """Called by the daemon once per run end (FINISHED or FAILED, not a user's stop). The final
        sync and the mail run in the background; with on_finish = "stop" the grace starts after."""
        with self._lock:
            if info.run_id and info.run_id == self.m.finish_run:
                return
            self.m = idle.run_ended(self.m, info.run_id)
            self._finish_queued = info.run_id
            self._save()
        self.jobs.submit("finish", self._finish, info)

    def _reconcile_finish(self, info: TrainingInfo, now: Now) -> None:
        """A run end whose final sync and mail a daemon restart cut short: finish it now. (Ends
        the daemon never saw are reported by the training module itself when it re-adopts; a
        FAILED run waiting for its automatic restart is never reported, and must not be.)"""
        if self.m.finish_done or not self.m.finish_run or self._finish_queued == self.m.finish_run:
            return
        if info.run_id != self.m.finish_run or info.state not in (TrainingState.FINISHED, TrainingState.FAILED):
            self.m = idle.finish_handled(self.m)  # a newer run started, or the record is gone: nothing left
            self._save()
            return
        self._finish_queued = info.run_id
        log.warning("finish_resumed", run_id=info.run_id)
        self.jobs.submit("finish", self._finish, info)

    def _finish(self, info: TrainingInfo) -> None:
        mode = finish_mode(self.conf.on_finish, info, people_here(self._signals))
        result = self.end_sync.run(self.sync, self._final_sync, info) if mode in ("stop", "idle") else None
        now = self._now()
        with self._lock:
            if mode == "stop":
                self.m = idle.begin_finish(self.m, now, self.th, info.run_id)
            else:
                self.m = idle.finish_handled(self.m)
            self._save()
            self._mail_finished(info, result, now, mode)
        ended = "finished" if info.state == TrainingState.FINISHED else "failed"
        self._fire("finish", {"reason": ended, "run_id": info.run_id, "exit_code": info.exit_code,
                              "target": (result.target if result else "") or self.conf.sync_target,
                              "final_sync_ok": "" if result is None else str(result.ok)})
        if result is not None and result.ok:
            self._fire("final_sync_done", {"reason": ended, "target": result.target or self.conf.sync_target,
                                           "final_sync_ok": "True"})

    # --- keepalive --------------------------------------------------------------------------------
    def keepalive(self, seconds: float) -> dict:
        from supervisor.interfaces import RequestError

        now = self._now()
        with self._lock:
            try:
                self.m, actions = idle.keepalive(self.m, seconds, now)
            except idle.Refused as e:
                raise RequestError(f"keepalive: {e}") from None
            self._carry_out(actions, now)
            self._save()
            until = self.m.keepalive_until
            if self.m.mode == idle.FINISH_MODE:
                after = f"then the machine stops {format_duration(self.th.finish_grace)} later (training has ended)"
            else:
                after = f"the idle clock starts then (warning {format_duration(self.th.warn_after)} later)"
            log.info("keepalive", seconds=seconds, until=until)
            return {"message": f"kept alive until {when(until)} ({format_duration(seconds)}); {after}",
                    "keepalive_until": until, "idle": self.status()["idle"]}

    def cancel_keepalive(self) -> dict:
        with self._lock:
            had = self.m.keepalive_until
            self.m = idle.cancel_keepalive(self.m)
            self._save()
            self.poll_soon()
            log.info("keepalive_cancelled", had=had)
            msg = "keepalive cancelled; the machine is judged by its activity again from the next poll" if had \
                else "no keepalive was set"
            return {"message": msg, "keepalive_until": None, "idle": self.status()["idle"]}

    # --- status -----------------------------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            rec = self.stopper.current(self.m.boot_id) if self.m.boot_id else None
            return status_of(self.m, self._signals, rec, self.th, self.conf, self.clock.time(),
                             self.clock.monotonic())

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until no background job is queued or running (tests; shutdown)."""
        return self.jobs.drain(timeout)

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        # the early poll is cheap: it polls only when a threshold is reached or a run started/ended
        return (Duty("idle", self.conf.idle.poll_interval, self.poll), Duty("idle_due", 1.0, self.poll_if_due))

    def status_blocks(self) -> dict[str, object]:
        s = self.status()
        return {"idle": s.get("idle", {}), "stop": s.get("stop", {})}

    def verbs(self) -> dict[str, Verb]:
        return {"keepalive": lambda a: self.cancel_keepalive() if (s := keepalive_seconds(a)) is None
                else self.keepalive(s)}


def stop_now(guard: IdleGuard, reason: str, why: str = "") -> None:
    """A stop through the guard's stop sequence with no idle warning (request_stop)."""
    guard.request_stop(reason, why)
