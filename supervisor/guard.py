"""IdleGuard: the thin shell around the idle machine. It gathers the probes' signals, steps the
machine, persists it (`idle.json`), sends the mails, and runs the stop sequence (`stop.json`) and
the on-finish handling in a background worker so the scheduler and the control socket never wait
on a final sync.

The daemon builds one after GPU, sync and training, schedules `poll()` every idle.poll_interval,
calls `on_training_ended(info)` when a run ends, and routes `supervisorctl keepalive` to
`keepalive()` / `cancel_keepalive()`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from . import idle
from .activity import CpuProbe, GpuProbe, JupyterProbe, OutputProbe, probe_ssh, probe_tmux, safe
from .context import Context
from .durations import format_bytes, format_duration
from .idle import (
    AbortStop,
    BeginStop,
    IdleMachine,
    Now,
    SendCancelled,
    SendWarning,
    Signal,
    Signals,
    Thresholds,
)
from .interfaces import FinalSyncResult, GpuView, SyncView, TrainingInfo, TrainingView
from .states import TRAINING_ALIVE, IdleState, TrainingState
from .stop import StopActionError, StopSequence, describe_action, may_act_without_sync
from .timefmt import clock as _clock
from .timefmt import hm, when
from .training import boot_id

log = structlog.get_logger("idle")

I = IdleState  # noqa: E741
STILL_UP_AFTER_S = 600.0  # a real stop action "succeeded" but the machine is still here: say so


def read_boot() -> tuple[str, float]:
    """(boot id, seconds since boot) of this machine."""
    try:
        up = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        up = 0.0
    return boot_id() or "unknown-boot", up


class IdleGuard:
    def __init__(self, ctx: Context, training: TrainingView, gpu: GpuView | None, sync: SyncView,
                 progress: Any = None, *, boot: Callable[[], tuple[str, float]] | None = None,
                 tmux_socket: str | None = None, runners: dict | None = None, env: dict[str, str] | None = None,
                 mail_flush_s: float = 30.0):
        self.ctx = ctx
        self.cfg = ctx.config
        self.th = Thresholds.from_config(self.cfg)
        self.training = training
        self.gpu = gpu
        self.sync = sync
        self.progress = progress
        self._boot = boot or read_boot
        self._tmux_socket = tmux_socket or getattr(getattr(training, "tmux", None), "socket", None) \
            or str(Path(self.cfg.state_dir) / "tmux.sock")
        self.mail_flush_s = mail_flush_s
        self._lock = threading.RLock()
        self.m = self._load()
        self.stopper = StopSequence(self.cfg, ctx.store, runners=runners, env=env)
        ic = self.cfg.idle
        self._jupyter = JupyterProbe(ic.jupyter_url, ic.jupyter_token_file) if ic.jupyter_url else None
        self._gpu_probe = GpuProbe()
        self._output = OutputProbe()
        self._cpu = CpuProbe()
        self._signals = Signals()
        self._last_info: TrainingInfo | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle_cond = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._stop_queued = False
        self._stop_seen = ""
        self._finish_queued: int | None = None
        self._still_up_alerted = False

    # --- persistence ----------------------------------------------------------------------------
    def _load(self) -> IdleMachine:
        raw = self.ctx.store.load("idle", None)
        if raw is None:
            return IdleMachine()
        try:
            return IdleMachine.from_dict(raw)
        except ValueError as e:
            # unusable: start over; the idle clock restarts now, it never jumps ahead
            self.ctx.store.problems.append(f"idle.json: {e}; the idle clock starts over")
            log.error("idle_state_unusable", error=str(e))
            return IdleMachine()

    def _save(self) -> None:
        try:
            self.ctx.store.save("idle", self.m.to_dict())
        except OSError as e:
            log.error("idle_state_save_failed", error=str(e))

    def _now(self) -> Now:
        bid, up = self._boot()
        return Now(self.ctx.clock.time(), self.ctx.clock.monotonic(), bid, up)

    # --- the poll ---------------------------------------------------------------------------------
    def poll(self) -> None:
        """Scheduled every idle.poll_interval. Probes outside the lock; never raises."""
        try:
            now = self._now()
            info = self._info()
            sig = self.gather(info, now)
            with self._lock:
                self._signals, self._last_info = sig, info
                before = self.m.state
                self.m, actions = idle.step(self.m, sig, now, self.th)
                if self.m.state != before:
                    log.info("idle_state", old=before.value, new=self.m.state.value, reasons=self.m.reasons,
                             idle_s=round(self.m.idle_s))
                self._carry_out(actions, now)
                self._save()
                self._reconcile_finish(info, now)
                self._schedule_stop(now)
                self._check_still_up(now)
        except Exception:  # noqa: BLE001 - the guard must keep polling
            log.exception("idle_poll_failed")

    def _info(self) -> TrainingInfo:
        try:
            return self.training.info()
        except Exception:  # noqa: BLE001
            log.exception("training_info_failed")
            return TrainingInfo(state=TrainingState.STOPPED)

    def gather(self, info: TrainingInfo, now: Now) -> Signals:
        """Every configured probe, afresh."""
        ic = self.cfg.idle
        alive = info.state in TRAINING_ALIVE
        items: list[Signal] = []
        if ic.count_ssh:
            items.append(Signal("ssh", *safe("ssh", probe_ssh)))
        if ic.count_tmux_clients:
            items.append(Signal("tmux", *safe("tmux", probe_tmux, self._tmux_socket,
                                              info.session or self.cfg.training.session)))
        if self._jupyter is not None:
            items.append(Signal("jupyter", *safe("jupyter", self._jupyter.probe, now.wall, ic.activity_window)))
        items.append(Signal("gpu", *safe("gpu", self._gpu_probe.probe, self.gpu, now.mono, ic.gpu_window,
                                         ic.gpu_util_threshold, alive)))
        if info.state == TrainingState.STARTING:
            items.append(Signal("training", True, "training: starting"))
        elif info.state == TrainingState.STOPPING:
            items.append(Signal("training", True, "training: stopping"))
        elif info.state == TrainingState.RUNNING:
            if ic.count_training_output:
                items.append(Signal("training_output", *safe("training", self._output.probe, info.log_path,
                                                             now.mono, now.wall, ic.activity_window)))
            if ic.count_training_cpu:
                items.append(Signal("training_cpu", *safe("training_cpu", lambda: self._cpu.probe(
                    self.training.pids(), now.mono, ic.training_cpu_threshold))))
        return Signals(tuple(items), training_alive=alive)

    def _carry_out(self, actions: list, now: Now) -> None:
        for a in actions:
            if isinstance(a, SendWarning):
                self._mail_warning(a, now)
            elif isinstance(a, SendCancelled):
                self._mail_cancelled(a, now)
            elif isinstance(a, BeginStop):
                self.stopper.begin(now.boot_id, a.cycle, a.reason, now.wall)
                self._stop_seen = f"{now.boot_id}:{a.cycle}"
            elif isinstance(a, AbortStop):
                self.stopper.cancel(now.wall, "; ".join(self.m.reasons) or "activity")
                self.ctx.alerts.resolve("stop:failing")

    # --- the stop sequence ------------------------------------------------------------------------
    def _schedule_stop(self, now: Now) -> None:
        if self.m.state != I.STOPPING or self._stop_queued:
            return
        sid = f"{now.boot_id}:{self.m.cycle}"
        rec = self.stopper.current(now.boot_id)
        if rec is None or rec.id != sid or rec.phase == "cancelled" or self._stop_seen != sid:
            # begin() resumes a record this boot's earlier daemon left unfinished
            rec = self.stopper.begin(now.boot_id, self.m.cycle, self.m.stop_reason or "idle", now.wall)
            self._stop_seen = sid
        if rec.phase == "done":
            self.m = idle.mark_stopped(self.m, dry_run=rec.action == "dry-run")
            self._save()
            return
        if rec.phase == "final_sync" and now.mono < rec.next_try_mono:
            return
        self._stop_queued = True
        self._submit("stop", self._stop_attempt)

    def _final_paths(self) -> list[str]:
        return list(self.cfg.stop.final_sync or self.cfg.sync.watch)

    def _final_sync(self) -> FinalSyncResult:
        try:
            return self.sync.final_sync(self._final_paths(), self.cfg.stop.final_sync_timeout)
        except Exception as e:  # noqa: BLE001 - a crashing sync is a failed sync, never a stop
            log.exception("final_sync_raised")
            return FinalSyncResult(ok=False, target="", error=f"final sync raised {type(e).__name__}: {e}")

    def _stop_attempt(self) -> None:
        try:
            self._stop_attempt_inner()
        finally:
            with self._lock:
                self._stop_queued = False

    def _stop_attempt_inner(self) -> None:
        with self._lock:
            rec = self.stopper.rec
            if self.m.state != I.STOPPING or rec is None or rec.phase not in ("final_sync", "acting"):
                return
            phase = rec.phase
        if phase == "final_sync":
            result = self._final_sync()
            now = self._now()
            with self._lock:
                if self.m.state != I.STOPPING or self.stopper.rec is not rec or rec.phase != "final_sync":
                    return  # cancelled by activity while the sync ran
                self.stopper.record_sync(result, now.wall, now.mono)
                if not result.ok:
                    why = may_act_without_sync(self.cfg, idle.idle_cost(self.m, self.cfg.price_per_hour))
                    if not why:
                        self._alert_sync_failed(result, now)
                        return
                    self.stopper.force(why, now.wall)
                self.ctx.alerts.resolve("stop:failing")
                if not rec.mailed:
                    self._mail_stopping(rec, now)
                    self.stopper.mark_mailed()
                self.m = idle.commit_stop(self.m)
                self._save()
            self.ctx.alerts.flush(self.mail_flush_s)  # the last words go out before the machine does
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
                self.ctx.alerts.fire("stop:failing", "stop_failed", "critical",
                                     f"stop action failed: {str(e)[:100]}",
                                     f"The stop action ({describe_action(self.cfg.stop)}) failed:\n  {e}\n\n"
                                     f"The machine is still running (and billing). The daemon tries again every "
                                     f"{format_duration(self.cfg.stop.retry_interval)}; any activity or "
                                     f"`supervisorctl keepalive 2h` cancels the stop.\n")
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
            self.ctx.alerts.event(f"stop:still-up:{rec.id}", "stop_failed", "critical",
                                  f"still running {format_duration(now.mono - rec.done_mono)} after the stop action",
                                  f"The stop action reported: {rec.result}\nbut this machine is still up and may "
                                  f"still be billing. Check the provider's console.\n")

    # --- training ended ---------------------------------------------------------------------------
    def on_training_ended(self, info: TrainingInfo) -> None:
        """Called by the daemon once per run end (FINISHED or FAILED, not a user's stop). The final
        sync and the mail run in the background; with on_finish = "stop" the grace starts after."""
        with self._lock:
            if info.run_id and info.run_id == self.m.finish_run:
                return
            self.m.finish_run, self.m.finish_done = info.run_id, False
            self._finish_queued = info.run_id
            self._save()
        self._submit("finish", self._finish, info)

    def _reconcile_finish(self, info: TrainingInfo, now: Now) -> None:
        """A run end whose final sync and mail a daemon restart cut short: finish it now. (Ends
        the daemon never saw are reported by the training module itself when it re-adopts; a
        FAILED run waiting for its automatic restart is never reported, and must not be.)"""
        if self.m.finish_done or not self.m.finish_run or self._finish_queued == self.m.finish_run:
            return
        if info.run_id != self.m.finish_run or info.state not in (TrainingState.FINISHED, TrainingState.FAILED):
            self.m.finish_done = True  # a newer run started, or the record is gone: nothing left to finish
            self._save()
            return
        self._finish_queued = info.run_id
        log.warning("finish_resumed", run_id=info.run_id)
        self._submit("finish", self._finish, info)

    def _finish(self, info: TrainingInfo) -> None:
        mode = self.cfg.training.on_finish
        result = self._final_sync() if mode in ("stop", "idle") else None
        now = self._now()
        with self._lock:
            if mode == "stop":
                self.m = idle.begin_finish(self.m, now, self.th, info.run_id)
            else:
                self.m.finish_done = True
            self._save()
            self._mail_finished(info, result, now)

    # --- keepalive --------------------------------------------------------------------------------
    def keepalive(self, seconds: float) -> dict:
        from .control import RequestError

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
            log.info("keepalive_cancelled", had=had)
            msg = "keepalive cancelled; the machine is judged by its activity again from the next poll" if had \
                else "no keepalive was set"
            return {"message": msg, "keepalive_until": None, "idle": self.status()["idle"]}

    # --- status -----------------------------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            m, sig = self.m, self._signals
            boot = m.boot_id
            rec = self.stopper.current(boot) if boot else None
            now = self.ctx.clock.time()
            proj = idle.projection(m, self.th, now)
            stop_at = proj["stop_at"]
            if m.state in (I.STOPPING, I.STOPPED) and rec is not None:
                stop_at = rec.done_at or rec.planned_at
            live_rec = rec if m.state in (I.STOPPING, I.STOPPED) else None
            return {
                "idle": {
                    "state": m.state.value,
                    "mode": m.mode,
                    "idle_since": m.idle_since if m.state != I.ACTIVE else None,
                    "idle_for_s": m.idle_s if m.state != I.ACTIVE else 0.0,
                    "warn_at": proj["warn_at"],
                    "stop_at": stop_at,
                    "reasons": list(m.reasons),
                    "checked": sig.notes(),
                    "keepalive_until": m.keepalive_until,
                    "warn_after_s": self.th.warn_after,
                    "stop_after_warning_s": idle.stop_wait(m, self.th) if m.state == I.WARNED
                    else self.th.stop_after_warning,
                    "idle_cost": idle.idle_cost(m, self.cfg.price_per_hour),
                    "training_stalled": self._looks_stalled(sig),
                },
                "stop": {
                    "action": self.cfg.stop.action,
                    "planned_at": live_rec.planned_at if live_rec else stop_at,
                    "phase": live_rec.phase if live_rec else None,
                    "reason": live_rec.reason if live_rec else (m.stop_reason or None),
                    "attempts": live_rec.attempts if live_rec else 0,
                    "last_error": live_rec.last_error if live_rec else "",
                    "final_sync": live_rec.synced if live_rec else None,
                    "result": live_rec.result if live_rec else "",
                    "final_sync_paths": self._final_paths(),
                },
            }

    def render_lines(self) -> list[str]:
        st = self.status()
        i, s = st["idle"], st["stop"]
        now = self.ctx.clock.time()
        state = i["state"]
        lines = []
        if state == "ACTIVE":
            why = "; ".join(i["reasons"]) or "starting up"
            lines.append(f"idle      ACTIVE  {why}")
            if i["mode"] == "finish":
                lines.append(f"          training ended: stops {format_duration(self.th.finish_grace)} after "
                             "the last activity ends")
            else:
                lines.append(f"          warns {format_duration(self.th.warn_after)} after the last activity, "
                             f"stops {format_duration(self.th.stop_after_warning)} after the warning")
        elif state == "IDLE":
            lines.append(f"idle      IDLE for {format_duration(i['idle_for_s'])} (since {hm(i['idle_since'])})  "
                         f"warn {_clock(i['warn_at'], now)}  stop {_clock(i['stop_at'], now)}")
        elif state == "WARNED":
            head = "training ended, grace" if i["mode"] == "finish" else f"warned {hm(i['warn_at'])}"
            lines.append(f"idle      WARNED  {head}  stop {_clock(i['stop_at'], now)}  "
                         "prevent: supervisorctl keepalive 2h")
        else:
            lines.append(f"idle      {state}  ({s['reason'] or 'idle'})  stop {s['action']}  "
                         f"phase {s['phase'] or '-'}")
        if i.get("idle_cost"):
            lines.append(f"          idle cost so far {i['idle_cost']:.2f} {self.cfg.currency}")
        if i["training_stalled"] and state != "ACTIVE":
            lines.append("          training is still running but looks stalled (no GPU load, no log output)")
        if s["last_error"]:
            lines.append(f"stop      {s['last_error'][:200]}")
        elif s["result"]:
            lines.append(f"stop      {s['result'][:200]}")
        return lines

    # --- mails ------------------------------------------------------------------------------------
    def _looks_stalled(self, sig: Signals) -> bool:
        return sig.training_alive and not sig.active

    def _stall_text(self) -> str:
        info = self._last_info
        if info is None or not self._looks_stalled(self._signals):
            return ""
        since = f", started {when(info.started_at)}" if info.started_at else ""
        return (f"\nThe training is still {info.state.value} (pid {info.pid}{since}) but looks stalled: "
                "no GPU load above the threshold and no log output. It is not killed: the final sync "
                "covers its outputs, then the machine stops.\n")

    def _cost_text(self) -> str:
        c = idle.idle_cost(self.m, self.cfg.price_per_hour)
        if c is None:
            return ""
        return f"Cost while idle: {c:.2f} {self.cfg.currency} (at {self.cfg.price_per_hour:.2f} {self.cfg.currency}/hour).\n"

    def _target_text(self) -> str:
        target = getattr(self.sync, "display", "") or self.cfg.sync.target
        paths = ", ".join(self._final_paths()) or "(no folders configured)"
        return f"{paths} to {target}" if target else "nothing (no sync.target configured)"

    def _mail_warning(self, a: SendWarning, now: Now) -> None:
        stop_at = now.wall + a.stop_in_s
        checked = "\n".join(f"  {n}" for n in self._signals.notes()) or "  (no probes)"
        stall = self._stall_text()
        subject = f"idle for {format_duration(a.idle_s)}: stopping at {hm(stop_at)} unless you act"
        if stall:
            subject += " (training looks stalled)"
        body = (f"This machine has been idle for {format_duration(a.idle_s)} (since {when(self.m.idle_since)}).\n"
                f"{self._cost_text()}"
                f"\nIt will stop at {when(stop_at)} (in {format_duration(a.stop_in_s)}), after a verified final "
                f"sync of {self._target_text()}.\nStop action: {describe_action(self.cfg.stop)}.\n"
                f"\nTo prevent it, run on the machine:\n\n    supervisorctl keepalive 2h\n\n"
                "Logging in over SSH, attaching to the training, Jupyter activity or GPU load also cancel it.\n"
                f"{stall}\nWhat was checked:\n{checked}\n")
        self.ctx.alerts.event(f"idle:warning:{a.cycle}", "idle_warning", "warning", subject, body)
        log.warning("idle_warning_sent", cycle=a.cycle, idle_s=round(a.idle_s), stop_at=stop_at)

    def _mail_cancelled(self, a: SendCancelled, now: Now) -> None:
        why = "; ".join(a.reasons) or "activity"
        subject = f"stop cancelled: {why}"
        body = (f"The {'stop that was under way' if a.during_stop else 'idle stop announced earlier'} is cancelled "
                f"at {when(now.wall)} because of activity:\n  " + "\n  ".join(a.reasons) +
                f"\n\nThe idle clock starts again once the machine is idle; the next warning comes "
                f"{format_duration(self.th.warn_after)} after that.\n")
        self.ctx.alerts.event(f"idle:cancelled:{a.cycle}", "stop_cancelled", "info", subject, body)
        log.info("stop_cancelled_mail", cycle=a.cycle, reasons=list(a.reasons))

    def _alert_sync_failed(self, r: FinalSyncResult, now: Now) -> None:
        unsynced = "\n".join(f"  {p}" for p in r.unsynced[:20]) or "  (unknown)"
        self.ctx.alerts.fire(
            "stop:failing", "stop_failed", "critical", f"NOT stopping: final sync failed ({(r.error or '?')[:80]})",
            f"The machine is due to stop ({self.m.stop_reason or 'idle'}), but the final sync of "
            f"{self._target_text()} did not verify:\n  {r.error or 'not verified'}\n\nNot yet safe:\n{unsynced}\n\n"
            f"Nothing is stopped while work is unsynced. The daemon retries every "
            f"{format_duration(self.cfg.stop.retry_interval)}.\n{self._cost_text()}"
            "To stop anyway, set stop.stop_even_if_sync_fails = true (or max_idle_cost) and restart the daemon; "
            "to keep the machine, run `supervisorctl keepalive 2h`.\n")
        log.error("final_sync_failed_not_stopping", error=r.error, unsynced=len(r.unsynced))

    def _mail_stopping(self, rec, now: Now) -> None:
        synced = rec.synced or {}
        if synced.get("ok"):
            what = (f"Final sync verified: {synced.get('files', 0)} files, {format_bytes(synced.get('bytes', 0))} "
                    f"at {synced.get('target') or '(no target)'} ({synced.get('uploaded_files', 0)} uploaded just now).\n"
                    f"Folders: {', '.join(self._final_paths()) or '(none)'}\n")
        else:
            unsynced = "\n".join(f"  {p}" for p in (synced.get("unsynced") or [])[:20])
            what = (f"The final sync did NOT verify ({synced.get('error') or '?'}), and the machine stops anyway "
                    f"because {rec.forced}.\nNot synced:\n{unsynced or '  (unknown)'}\n")
        reason = "training finished" if rec.reason == "finished" else f"idle for {format_duration(self.m.idle_s)}"
        stall = ""
        if self._looks_stalled(self._signals):
            stall = ("\nThe training was still running but looked stalled (no GPU load, no log output); it was not "
                     "killed separately.\n")
        subject = f"stopping now ({reason}): " + (
            f"final sync verified, {synced.get('files', 0)} files at {synced.get('target') or 'no target'}"
            if synced.get("ok") else "final sync FAILED, stopping anyway")
        body = (f"Stopping this machine at {when(now.wall)} ({reason}).\n\n{what}"
                f"Stop action: {describe_action(self.cfg.stop)}.\n{self._cost_text()}{stall}")
        self.ctx.alerts.event(f"stop:now:{rec.id}", "stopping", "warning", subject, body)

    def _mail_finished(self, info: TrainingInfo, r: FinalSyncResult | None, now: Now) -> None:
        ok = info.state == TrainingState.FINISHED
        how = f"killed by {info.signal}" if info.signal else (
            f"exit code {info.exit_code}" if info.exit_code is not None else "exit status unknown")
        ran = ""
        if info.started_at and info.ended_at:
            ran = f"Ran: {when(info.started_at)} -> {when(info.ended_at)} " \
                  f"({format_duration(info.ended_at - info.started_at)})\n"
        prog = ""
        if self.progress is not None:
            try:
                p = self.progress.snapshot(now.wall) or {}
                bits = []
                if p.get("step") is not None:
                    bits.append(f"step {p['step']}" + (f"/{p['max_steps']}" if p.get("max_steps") else ""))
                if p.get("epoch") is not None:
                    bits.append(f"epoch {p['epoch']:.2f}")
                if p.get("loss") is not None:
                    bits.append(f"loss {p['loss']:.4g}")
                if bits:
                    prog = f"Last progress: {', '.join(bits)}\n"
                c = self.progress.cost(now.wall) or {}
                if c.get("spent") is not None:
                    prog += f"Cost so far: {c['spent']:.2f} {c.get('currency') or self.cfg.currency}\n"
            except Exception:  # noqa: BLE001 - a progress bug must not lose the result mail
                log.exception("progress_for_mail_failed")
        if r is None:
            outputs = f"Outputs: {info.workdir or '(workdir not set)'}; synced continuously to " \
                      f"{self.cfg.sync.target or '(no sync target)'}\n"
        elif r.ok:
            outputs = (f"Outputs: final sync verified, {r.files} files ({format_bytes(r.bytes)}) at "
                       f"{r.target or '(no target: nothing leaves this machine)'}; folders "
                       f"{', '.join(self._final_paths()) or '(none)'}\n")
        else:
            outputs = (f"Outputs: the final sync FAILED ({r.error}); not yet safe:\n"
                       + "\n".join(f"  {p}" for p in r.unsynced[:20]) + "\n")
        mode = self.cfg.training.on_finish
        if mode == "stop":
            stop_at = idle.projection(self.m, self.th, now.wall)["stop_at"]
            nxt = (f"\nNext: this machine stops at {when(stop_at)} (in {format_duration(self.th.finish_grace)}), "
                   "after a verified final sync.\nTo keep it: log in over SSH (the stop then waits until "
                   f"{format_duration(self.th.finish_grace)} after you leave) or run\n\n    supervisorctl keepalive 2h\n")
            if self.m.state in (I.STOPPING, I.STOPPED):
                nxt = "\nA stop was already under way.\n"
        elif mode == "idle":
            nxt = (f"\nNext: idle protection decides: a warning after {format_duration(self.th.warn_after)} "
                   f"idle, the stop {format_duration(self.th.stop_after_warning)} later.\n")
        else:
            nxt = "\non_finish = \"none\": nothing is stopped because the training ended.\n"
        subject = f"training {'finished' if ok else 'FAILED'} ({how})"
        if mode == "stop" and self.m.state == I.WARNED:
            subject += f"; stopping at {hm(idle.projection(self.m, self.th, now.wall)['stop_at'])}"
        body = (f"Training {'finished' if ok else 'failed'}: {how} (run {info.run_id}).\n"
                f"Command: {info.command}\n{ran}{prog}{outputs}Log: {info.log_path}\n{nxt}")
        self.ctx.alerts.event(f"training:end:{info.run_id}:{int(info.ended_at or now.wall)}",
                              "training_finished" if ok else "training_failed", "info" if ok else "warning",
                              subject, body)

    # --- the background worker --------------------------------------------------------------------
    def _submit(self, name: str, fn: Callable, *args) -> None:
        with self._lock:
            self._pending += 1
            self._jobs.put((name, fn, args))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run_jobs, name="idle-worker", daemon=True)
                self._worker.start()

    def _run_jobs(self) -> None:
        while True:
            with self._lock:
                if self._jobs.empty():
                    self._worker = None
                    return
                name, fn, args = self._jobs.get()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a failed job is logged; the next poll tries again
                log.exception("idle_job_failed", job=name)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._idle_cond.notify_all()

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until no background job is queued or running (tests; shutdown)."""
        import time

        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle_cond.wait(left)
        return True
