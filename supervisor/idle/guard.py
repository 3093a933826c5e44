"""IdleGuard: the thin shell around the idle machine. It gathers the probes' signals, steps the
machine and persists it (`idle.json`, held in `shared.GuardState`), handles a run's end and
`keepalive`, and is where the stop door lands (`request_stop`, `withdraw_stop`: the reason stands in
the record, and the stop machine begins, takes over or ends a stop). The stop itself is the stop
wing's (`stop.driver.StopDriver`: the interrupt, the final sync, the hooks, the action, in a
background worker so the scheduler and the control socket never wait on a final sync; its mails
`stop.announce`); what the idle side tells the owner is `announce.Announcer`. Decisions live in
`machine.py` (and stop/), its config view and the facts it reports in `facts.py`, words in
`notify/mails/idle.py` and `mails/training.py`, status lines in `render.idle_lines`.

The daemon lists its duties (`poll()` every idle.poll_interval, `poll_if_due()` every second), calls
`on_training_ended(info)` when a run ends, and routes `supervisorctl keepalive` to its verb.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from supervisor.clock import Clock
from supervisor.context import Context
from supervisor.durations import format_duration
from supervisor.idle import machine as idle
from supervisor.idle.activity import Probes
from supervisor.idle.announce import Announcer
from supervisor.idle.facts import GuardConfig, Jobs, finish_mode, people_here, status_of
from supervisor.idle.machine import IdleMachine, Now, Thresholds
from supervisor.idle.shared import GuardState
from supervisor.interfaces import Duty, GpuView, ProgressView, SyncView, TrainingInfo, TrainingView, Verb
from supervisor.notify.alerts import Alerts
from supervisor.notify.mails import stall as stall_words
from supervisor.progress import stall
from supervisor.requests import keepalive_seconds
from supervisor.statefile import StateStore
from supervisor.states import IdleState, TrainingState
from supervisor.status import Block
from supervisor.status.idle import IdleBlock, StopBlock
from supervisor.stop.announce import StopAnnouncer
from supervisor.stop.driver import StopDriver
from supervisor.stop.machine import AbortStop, BeginStop
from supervisor.stop.record import StopSequence
from supervisor.timefmt import when

if TYPE_CHECKING:
    from supervisor.hooks.runner import Hooks

log = structlog.get_logger("idle")

I = IdleState  # noqa: E741


class IdleGuard:
    def __init__(self, conf: GuardConfig, clock: Clock, store: StateStore, alerts: Alerts,
                 training: TrainingView, gpu: GpuView | None, sync: SyncView, progress: ProgressView | None = None, *,
                 tmux_socket: str | None = None, runners: dict | None = None, env: dict[str, str] | None = None,
                 mail_flush_s: float = 30.0, full_at_end: Callable[[list[str]], str] | None = None,
                 run_total: Callable[[], str] | None = None, hooks: Hooks | None = None,
                 cap_moment: Callable[[str], tuple[float | None, str]] | None = None):
        self.conf = conf
        self.clock, self.alerts = clock, alerts
        self.th = Thresholds.of(conf.idle, conf.finish_grace)
        self.training = training
        self.gpu = gpu
        self.sync = sync
        self.progress = progress
        socket = tmux_socket or getattr(getattr(training, "tmux", None), "socket", None) \
            or str(Path(conf.state_dir) / "tmux.sock")
        self.probes = Probes(conf.idle, socket, conf.session, conf.interrupt_patience)
        self.st = GuardState(store, clock)
        self.jobs = Jobs(self.st.lock)
        self.stopper = StopSequence(conf.stop, store, clock, state_dir=conf.state_dir,
                                    command_env=conf.training_env, runners=runners, env=env, plan=conf.stop_plan)
        self.tell = Announcer(conf, self.th, self.st, alerts, sync, progress, full_at_end, run_total)
        self.stop = StopDriver(conf, self.st, self.stopper, alerts, training, sync,
                               StopAnnouncer(conf, self.st, alerts, sync, self.tell.cost), self.jobs, self.poll_soon,
                               lambda: idle.idle_for(self.st.m, self.th, self.clock.monotonic()),
                               hooks=hooks, cap_moment=cap_moment, mail_flush_s=mail_flush_s)
        self._finish_queued: int | None = None
        self._poll_wanted = False

    @classmethod
    def of(cls, ctx: Context, conf: GuardConfig, training: TrainingView, gpu: GpuView | None, sync: SyncView,
           progress: ProgressView | None = None, **kw: Any) -> IdleGuard:
        """The guard as the daemon wires it: its slice of the config, the shared clock, store and alerts."""
        return cls(conf, ctx.clock, ctx.store, ctx.alerts, training, gpu, sync, progress, **kw)

    @property
    def m(self) -> IdleMachine:
        return self.st.m

    # --- where the stop runner's door lands (supervisor.stop) --------------------------------------
    def request_stop(self, word: str, why: str) -> bool:
        """The reason stands, and begins or takes over a stop as the rule table says. False when no
        new stop began (one that ranks as high is under way or acting, or its notice runs first)."""
        st = self.st
        now = st.now()
        with st.lock:
            st.m, actions = idle.request_stop(st.m, now, word, why, self.th)
            began = any(isinstance(a, BeginStop) for a in actions)
            log.warning("stop_requested", reason=word, why=why, began=began, state=st.m.state.value)
            self.carry_out(actions, now)
            st.save()
        self.poll_soon()
        return began

    def withdraw_stop(self, word: str) -> None:
        """Its wing has no cause any more: the reason stops standing, and a stop it leads that has not
        begun its action ends now (during its final sync: the sync's result is then not acted on)."""
        st = self.st
        now = st.now()
        with st.lock:
            had = word in {x.word for x in st.m.standing}
            st.m, actions = idle.withdraw(st.m, now, word, self.th)
            if had:
                log.warning("stop_withdrawn", reason=word, state=st.m.state.value)
            self.carry_out(actions, now)
            st.save()
        self.poll_soon()

    def carry_out(self, actions: list, now: Now) -> None:
        """The machines' actions (under the record's lock): the idle side's mails, the stop's records."""
        for a in actions:
            if isinstance(a, idle.SendWarning):
                self.tell.warning(a, now)
                self.stop.fire("idle_warning", {"reason": "idle", "idle_s": round(a.idle_s),
                                                "stop_at": round(now.wall + a.stop_in_s),
                                                "target": self.conf.sync_target})
            elif isinstance(a, idle.SendCancelled):
                self.tell.cancelled(a, now)
            elif isinstance(a, BeginStop | AbortStop):
                self.stop.carry_out(a, now)

    # --- the poll ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Scheduled every idle.poll_interval. Probes outside the lock; never raises."""
        try:
            st = self.st
            now = st.now()
            info = self.stop.training_info()
            sig = self.probes.gather(info, now, self.gpu, self.training.pids)
            if why := self._stall_counts_idle(info, now):
                sig = replace(idle.people_only(sig, why), stalled=why)  # its warning asks for `stalled`
            with st.lock:
                if self.stop.interrupted(info):
                    sig = idle.people_only(sig, "the stop is interrupting the training")
                st.signals, st.info = sig, info
                before = st.m.state
                st.m, actions = idle.step(st.m, sig, now, self.th)
                if st.m.state != before:
                    log.info("idle_state", old=before.value, new=st.m.state.value, reasons=st.m.reasons,
                             idle_s=round(st.m.idle_s))
                self.carry_out(actions, now)
                st.save()
                self._reconcile_finish(info, now)
                self.stop.schedule(now, info)
                self.stop.check_still_up(now)
        except Exception:  # noqa: BLE001 - the guard must keep polling
            log.exception("idle_poll_failed")

    def poll_soon(self) -> None:
        """Something the idle judgement depends on just changed (a run started or ended): judge
        again within a second instead of at the next scheduled poll."""
        self._poll_wanted = True

    def poll_if_due(self) -> None:
        """Run every second: polls now when asked to, or when a poll would cross the warning or stop
        threshold, so the times status and the mails announce are the times things happen."""
        with self.st.lock:
            wanted = self._poll_wanted or idle.due(self.st.m, self.th, self.clock.monotonic())
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

    # --- training ended ---------------------------------------------------------------------------
    def on_training_ended(self, info: TrainingInfo) -> None:
        """Called by the daemon once per run end (FINISHED or FAILED, not a user's stop). The final
        sync and the mail run in the background; with on_finish = "stop" the grace starts after."""
        with self.st.lock:
            if info.run_id and info.run_id == self.st.m.finish_run:
                return
            self.st.m = idle.run_ended(self.st.m, info.run_id)
            self._finish_queued = info.run_id
            self.st.save()
        self.jobs.submit("finish", self._finish, info)

    def _reconcile_finish(self, info: TrainingInfo, now: Now) -> None:
        """A run end whose final sync and mail a daemon restart cut short: finish it now. (Ends
        the daemon never saw are reported by the training module itself when it re-adopts; a
        FAILED run waiting for its automatic restart is never reported, and must not be.)"""
        m = self.st.m
        if m.finish_done or not m.finish_run or self._finish_queued == m.finish_run:
            return
        if info.run_id != m.finish_run or info.state not in (TrainingState.FINISHED, TrainingState.FAILED):
            self.st.m = idle.finish_handled(m)  # a newer run started, or the record is gone: nothing left
            self.st.save()
            return
        self._finish_queued = info.run_id
        log.warning("finish_resumed", run_id=info.run_id)
        self.jobs.submit("finish", self._finish, info)

    def _finish(self, info: TrainingInfo) -> None:
        st = self.st
        mode = finish_mode(self.conf.on_finish, info, people_here(st.signals))
        result = self.stop.end_sync.run(self.sync, self.stop.final_sync, info) if mode in ("stop", "idle") else None
        now = st.now()
        with st.lock:
            if mode == "stop":
                # `finished` or `failed` through the door, with the finish grace (stop.rules)
                st.m = idle.begin_finish(st.m, now, self.th, info.run_id,
                                         "finished" if info.state == TrainingState.FINISHED else "failed")
            else:
                st.m = idle.finish_handled(st.m)
            st.save()
            self.tell.finished(info, result, now, mode)
        ended = "finished" if info.state == TrainingState.FINISHED else "failed"
        self.stop.fire("finish", {"reason": ended, "run_id": info.run_id, "exit_code": info.exit_code,
                              "target": (result.target if result else "") or self.conf.sync_target,
                              "final_sync_ok": "" if result is None else str(result.ok)})
        if result is not None and result.ok:
            self.stop.fire("final_sync_done", {"reason": ended, "target": result.target or self.conf.sync_target,
                                           "final_sync_ok": "True"})

    # --- keepalive --------------------------------------------------------------------------------
    def keepalive(self, seconds: float) -> dict:
        from supervisor.interfaces import RequestError

        st = self.st
        now = st.now()
        with st.lock:
            try:
                st.m, actions = idle.keepalive(st.m, seconds, now)
            except idle.Refused as e:
                raise RequestError(f"keepalive: {e}") from None
            self.carry_out(actions, now)
            st.save()
            until = st.m.keepalive_until
            if st.m.mode == idle.FINISH_MODE:
                after = f"then the machine stops {format_duration(self.th.finish_grace)} later (training has ended)"
            else:
                after = f"the idle clock starts then (warning {format_duration(self.th.warn_after)} later)"
            log.info("keepalive", seconds=seconds, until=until)
            return {"message": f"kept alive until {when(until)} ({format_duration(seconds)}); {after}",
                    "keepalive_until": until, "idle": self.status()["idle"]}

    def cancel_keepalive(self) -> dict:
        with self.st.lock:
            had = self.st.m.keepalive_until
            self.st.m = idle.cancel_keepalive(self.st.m)
            self.st.save()
            self.poll_soon()
            log.info("keepalive_cancelled", had=had)
            msg = "keepalive cancelled; the machine is judged by its activity again from the next poll" if had \
                else "no keepalive was set"
            return {"message": msg, "keepalive_until": None, "idle": self.status()["idle"]}

    # --- status -----------------------------------------------------------------------------------
    def status(self) -> dict:
        st = self.st
        with st.lock:
            rec = self.stopper.current(st.m.boot_id) if st.m.boot_id else None
            return status_of(st.m, st.signals, rec, self.th, self.conf, self.clock.time(), self.clock.monotonic())

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until no background job is queued or running (tests; shutdown)."""
        return self.jobs.drain(timeout)

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        # the early poll is cheap: it polls only when a threshold is reached or a run started/ended
        return (Duty("idle", self.conf.idle.poll_interval, self.poll), Duty("idle_due", 1.0, self.poll_if_due))

    def status_blocks(self) -> tuple[Block, ...]:
        s = self.status()
        return IdleBlock.of(s.get("idle", {})), StopBlock.of(s.get("stop", {}))

    def verbs(self) -> dict[str, Verb]:
        return {"keepalive": lambda a: self.cancel_keepalive() if (s := keepalive_seconds(a)) is None
                else self.keepalive(s)}

