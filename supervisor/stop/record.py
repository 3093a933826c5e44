"""The stop's record and sequence (`stop.json`): interrupt, final sync, action, each step written
before the next. The actions themselves are in `actions` (poweroff, the command) and `carry` (the
provider's stop).

The sequence is [interrupt a live training and wait for its end] -> final sync -> (verified, or
forced) -> "stopping now" mail -> action -> done. Every step is written to `stop.json` before the
next begins, so a daemon killed mid-stop resumes where it was instead of starting over, and a stop
from an earlier boot is never resumed. The training is interrupted the way `supervisorctl stop`
does it (SIGINT, then SIGTERM and SIGKILL `training.stop_grace` apart) so it can save, and the final
sync comes after its end, so what it saved on the way out goes up before the machine stops.

Exactly once, after a `kill -9` between "action started" and "action done":
- `dry-run`: the record *is* the action (one atomic write), so it cannot happen twice;
- `command`: runs detached from the daemon under a wrapper that writes its exit status to a file
  named in the record, with the wrapper's PID and start time recorded before the wait. A new daemon
  reads the exit file if it is there, waits for the recorded process if it still runs, and runs
  the command again only when neither exists (the command was killed, or never started);
- `poweroff`: re-running it is harmless (a second `systemctl poweroff` changes nothing), so an
  unfinished one is simply re-run;
- `auto`, `provider` and `ec2` (the provider's own stop, supervisor.stop.carry): the attempt is
  saved in the record (`provider`) before the one call, so a resumed stop reads the provider's
  state instead of calling again, and the stop is done only when the provider reports the machine
  not billed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from supervisor import records
from supervisor.clock import Clock
from supervisor.config import StopConfig
from supervisor.interfaces import FinalSyncResult
from supervisor.states import StopPhase, check_stop_move
from supervisor.stop.actions import COMMAND_TIMEOUT_S, poweroff, proc_ctime, read_exit, start_command
from supervisor.stop.choose import PROVIDER_ACTIONS, Plan
from supervisor.stop.providers.base import StopActionError
from supervisor.timefmt import when

log = structlog.get_logger("stop")

P = StopPhase
MAX_ACTION_ATTEMPTS = 5


# --- the persisted sequence ----------------------------------------------------------------------
@dataclass
class StopRecord:
    id: str
    boot_id: str
    cycle: int
    reason: str                  # idle | finished | max_cost | deadline | max_runtime
    action: str
    planned_at: float            # wall time the stop began
    phase: StopPhase = P.FINAL_SYNC
    attempts: int = 0            # final-sync attempts
    next_try_mono: float = 0.0
    last_error: str = ""
    synced: dict | None = None   # the last FinalSyncResult, as a dict
    forced: str = ""             # why the action ran although the final sync did not verify
    mailed: bool = False         # the "stopping now" mail is out
    action_attempts: int = 0
    action_started_at: float | None = None
    action_pid: int | None = None
    action_ctime: float | None = None
    exit_file: str = ""
    result: str = ""
    done_at: float | None = None
    done_mono: float | None = None
    history: list[str] = field(default_factory=list)
    interrupted_run: int = 0     # the live training this stop interrupted (0 = none)
    interrupted_pid: int | None = None
    interrupted_at: float | None = None
    interrupted_mono: float | None = None
    interrupt_ended: str = ""    # how it ended ("exit code 0"), or "" while waiting / when it outlived every signal
    provider: dict | None = None  # the provider stop's attempts and confirmation (supervisor.stop.confirm)

    @classmethod
    def from_dict(cls, d: Any) -> StopRecord:
        """ValueError naming the field when `d` is not a record this code wrote."""
        if isinstance(d, dict):
            for f in dataclasses.fields(cls):
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in d:
                    raise ValueError(f"stop record: {f.name} is missing")
        return records.load(cls, d, "stop record")

    def note(self, wall: float, text: str) -> None:
        self.history = (self.history + [f"{when(wall)} {text}"])[-30:]


def move(rec: StopRecord, new: StopPhase) -> None:
    """The one place a stop record changes phase; an illegal move raises IllegalTransition."""
    check_stop_move(rec.phase, new)
    rec.phase = new


def may_act_without_sync(stop: StopConfig, idle_cost: float | None, max_idle_cost: float | None,
                         currency: str, cap: str = "") -> str:
    """Why the action may run although the final sync did not verify ("" = it may not). `cap`: the
    moment of a cap (spend, deadline, runtime) has come, said in words."""
    if cap:
        return cap
    if stop.stop_even_if_sync_fails:
        return "stop.stop_even_if_sync_fails is set"
    if max_idle_cost is not None and idle_cost is not None and idle_cost >= max_idle_cost:
        return (f"the idle cost {idle_cost:.2f} {currency} reached max_idle_cost "
                f"{max_idle_cost:.2f} {currency}")
    return ""


def sync_summary(r: FinalSyncResult) -> dict:
    # damaged / partial_units: what went up as it is although it is not whole (newer sync engines say)
    return {"ok": r.ok, "target": r.target, "files": r.files, "bytes": r.bytes,
            "uploaded_files": r.uploaded_files, "error": r.error, "unsynced": list(r.unsynced[:50]),
            "damaged": list(getattr(r, "damaged", None) or [])[:50],
            "partial_units": list(getattr(r, "partial_units", None) or [])[:50],
            "newest": list(getattr(r, "newest", None) or [])[:50],
            "unselected": list(getattr(r, "unselected", None) or [])[:50],
            "unselected_files": r.unselected_files, "unselected_bytes": r.unselected_bytes,
            "unselected_hold": r.unselected_hold,
            "finals": list(getattr(r, "finals", None) or [])[:50]}


class StopSequence:
    """Owns stop.json. Not thread-safe by itself: the guard calls it from one worker at a time
    and reads it under its own lock."""

    NAME = "stop"

    def __init__(self, cfg: StopConfig, store, clock: Clock, *, state_dir: str | Path,
                 command_env: dict[str, str] | None = None,
                 runners: dict[str, Callable[[StopConfig], str]] | None = None, env: dict[str, str] | None = None,
                 plan: Plan | None = None, sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.dir = Path(state_dir)
        self.runners = {"poweroff": lambda c: poweroff(), **{a: self._provider for a in PROVIDER_ACTIONS},
                        **(runners or {})}
        self.plan = plan                        # what stop.action means here (the daemon's, at start)
        self.sleep = sleep                      # between reads of the provider's state
        self.env = env                          # the stop command's environment (default: the daemon's) ...
        self.command_env = command_env or {}    # ... plus these (training.env: provider ids, tokens)
        self.rec: StopRecord | None = None
        raw = store.load(self.NAME, None)
        if raw is not None:
            try:
                self.rec = StopRecord.from_dict(raw)
            except ValueError as e:
                store.problems.append(f"stop.json: {e}; no stop is resumed")
                log.error("stop_record_unusable", error=str(e))

    def save(self) -> None:
        """Persist the record. A full disk must not hold the stop for ever (the machine would bill on):
        the sequence goes on with its record in memory; after a restart a repeated dry-run record or
        poweroff is harmless, while a stop that never happens is not."""
        if self.rec is None:
            return
        try:
            self.store.save(self.NAME, asdict(self.rec))
        except OSError as e:
            log.error("stop_record_not_saved", error=str(e), phase=str(self.rec.phase))

    # --- the moves --------------------------------------------------------------------------------
    def begin(self, boot_id: str, cycle: int, reason: str, wall: float) -> StopRecord:
        """Start (or, after a restart in the same boot, resume) the stop for this idle cycle."""
        sid = f"{boot_id}:{cycle}"
        if self.rec is not None and self.rec.id == sid and self.rec.phase in (P.INTERRUPTING, P.FINAL_SYNC, P.ACTING):
            self.rec.note(wall, "resumed after a daemon restart")
            self.save()
            log.warning("stop_resumed", id=sid, phase=self.rec.phase)
            return self.rec
        if self.rec is not None and self.rec.id == sid and self.rec.phase == P.DONE:
            return self.rec
        self.rec = StopRecord(id=sid, boot_id=boot_id, cycle=cycle, reason=reason, action=self.cfg.action,
                              planned_at=wall)
        self.rec.note(wall, f"stop begun ({reason}); action {self.cfg.action}")
        self.save()
        log.warning("stop_begun", id=sid, reason=reason, action=self.cfg.action)
        return self.rec

    def current(self, boot_id: str) -> StopRecord | None:
        """The record of a stop of this boot (a previous boot's stop is history, never resumed)."""
        if self.rec is not None and self.rec.boot_id == boot_id:
            return self.rec
        return None

    def cancel(self, wall: float, why: str) -> None:
        if self.rec is not None and self.rec.phase in (P.INTERRUPTING, P.FINAL_SYNC):
            move(self.rec, P.CANCELLED)
            self.rec.note(wall, f"cancelled: {why}")
            self.save()
            log.info("stop_cancelled", id=self.rec.id, why=why)

    def interrupting(self, run_id: int, pid: int | None, wall: float, mono: float) -> None:
        """A live training is being stopped before the final sync."""
        rec = self._rec()
        move(rec, P.INTERRUPTING)
        rec.interrupted_run, rec.interrupted_pid, rec.interrupted_at, rec.interrupted_mono = run_id, pid, wall, mono
        rec.interrupt_ended = ""
        rec.note(wall, f"interrupting run {run_id} (pid {pid}) before the final sync: SIGINT, then SIGTERM "
                       "and SIGKILL as `supervisorctl stop` does")
        self.save()
        log.warning("stop_interrupting_training", id=rec.id, run_id=run_id, pid=pid)

    def interrupted(self, ended: str, wall: float, text: str) -> None:
        """The interrupted training is gone (`ended` says how; "" = it outlived every signal): sync now."""
        rec = self._rec()
        move(rec, P.FINAL_SYNC)
        rec.interrupt_ended, rec.next_try_mono = ended, 0.0
        rec.note(wall, text)
        self.save()
        log.warning("stop_training_ended", id=rec.id, run_id=rec.interrupted_run, ended=ended or "not ended")

    def record_sync(self, r: FinalSyncResult, wall: float, mono: float) -> None:
        rec = self._rec()
        rec.attempts += 1
        rec.synced = sync_summary(r)
        if r.ok:
            rec.last_error = ""
            rec.note(wall, f"final sync verified: {r.files} files, {r.bytes} bytes at {r.target or '(no target)'}")
        else:
            rec.last_error = f"final sync failed: {r.error or 'not verified'}"
            rec.next_try_mono = mono + self.cfg.retry_interval
            rec.note(wall, rec.last_error)
        self.save()

    def hold(self, why: str, wall: float, mono: float) -> None:
        """Something other than the sync holds the stop (a required hook failed): retry as after a
        failed final sync."""
        rec = self._rec()
        rec.last_error = why
        rec.next_try_mono = mono + self.cfg.retry_interval
        rec.note(wall, why)
        self.save()

    def force(self, why: str, wall: float) -> None:
        rec = self._rec()
        rec.forced = why
        rec.note(wall, f"stopping although the final sync failed: {why}")
        self.save()

    def mark_mailed(self) -> None:
        self._rec().mailed = True
        self.save()

    def act(self, wall: float, mono: float) -> str:
        """Run the action (or finish one a killed daemon left in flight). Returns what it reported;
        raises StopActionError when the machine was not stopped."""
        rec = self._rec()
        action = rec.action
        resuming = rec.phase == P.ACTING
        if action == "dry-run":
            move(rec, P.DONE)
            rec.done_at, rec.done_mono = wall, mono
            rec.result = f"dry-run: would have stopped the machine ({rec.reason})"
            rec.action_attempts += 1
            rec.note(wall, rec.result)
            self.save()  # the record is the action: written once, atomically
            log.warning("stop_dry_run", id=rec.id, reason=rec.reason)
            return rec.result
        if action == "command":
            return self._act_command(rec, wall, mono, resuming)
        if resuming and action not in PROVIDER_ACTIONS:  # a provider stop reads its state first (carry)
            rec.note(wall, f"re-running {action} (a daemon restart interrupted it; harmless to repeat)")
        move(rec, P.ACTING)
        rec.action_attempts += 1
        rec.action_started_at = wall
        self.save()
        try:
            result = self.runners[action](self.cfg)
        except StopActionError as e:
            self._action_failed(rec, str(e), wall, mono)
            raise
        except Exception as e:  # noqa: BLE001 - boto3 and friends raise their own types
            self._action_failed(rec, f"{type(e).__name__}: {e}", wall, mono)
            raise StopActionError(str(e)) from e
        self._done(rec, result, wall, mono)
        return result

    def _provider(self, cfg: StopConfig) -> str:
        """auto / provider / ec2: the provider's own stop, confirmed (supervisor.stop.carry); the
        attempt lives in the record, saved before the call."""
        from supervisor.stop.carry import carry_out
        from supervisor.stop.choose import terminate_allowed

        rec, seq = self._rec(), self
        if self.plan is None:  # built without the daemon's plan (a test, a one-shot): decide now
            from supervisor.stop.resolve import choose

            self.plan = choose(cfg, self.env)

        class Box:
            def load(self) -> dict | None:
                return rec.provider

            def save(self, d: dict) -> None:
                rec.provider = d
                seq.save()

            def note(self, text: str) -> None:
                rec.note(seq.clock.time(), text)
                seq.save()

        return carry_out(self.plan, Box(), verified_why=terminate_allowed(rec.synced, rec.forced),
                         poweroff=lambda: self.runners["poweroff"](cfg), confirm_within=cfg.confirm_within,
                         wall=self.clock.time, mono=self.clock.monotonic, sleep=self.sleep)

    def _act_command(self, rec: StopRecord, wall: float, mono: float, resuming: bool) -> str:
        exit_file = Path(rec.exit_file) if rec.exit_file else None
        code = read_exit(exit_file) if (resuming and exit_file) else None
        ctime = proc_ctime(rec.action_pid) if resuming else None
        alive = ctime is not None and (rec.action_ctime is None or abs(ctime - rec.action_ctime) < 1.0)
        if code is None and not alive:
            if resuming:
                rec.note(wall, "the stop command left no exit status and is not running: running it again"
                         if rec.action_pid else "the stop command had not started: starting it")
            move(rec, P.ACTING)
            rec.action_attempts += 1
            rec.action_started_at = wall
            exit_file = self.dir / "stop-actions" / f"{rec.id.replace(':', '-')}-{rec.action_attempts}.exit"
            rec.exit_file, rec.action_pid, rec.action_ctime = str(exit_file), None, None
            self.save()
            env = dict(self.env if self.env is not None else os.environ)
            env.update(self.command_env)
            pid = start_command(self.cfg.command, exit_file, self.dir / "stop-action.log", env)
            rec.action_pid, rec.action_ctime = pid, proc_ctime(pid)
            rec.note(wall, f"stop command started (pid {pid})")
            self.save()
            log.warning("stop_command_started", pid=pid, command=self.cfg.command)
        elif code is None:
            rec.note(wall, f"waiting for the stop command already running (pid {rec.action_pid})")
            self.save()
        assert exit_file is not None
        code = self._wait_exit(rec, exit_file)
        if code is None:
            msg = f"stop command did not finish within {COMMAND_TIMEOUT_S:.0f}s"
            self._action_failed(rec, msg, wall, mono)
            raise StopActionError(msg)
        if code != 0:
            msg = f"stop command exited {code}: {self._log_tail()}"
            self._action_failed(rec, msg, wall, mono)
            raise StopActionError(msg)
        result = "stop command succeeded"
        self._done(rec, result, wall, mono)
        return result

    def _wait_exit(self, rec: StopRecord, exit_file: Path) -> int | None:
        deadline = self.clock.monotonic() + COMMAND_TIMEOUT_S
        pid = rec.action_pid
        while self.clock.monotonic() < deadline:
            code = read_exit(exit_file)
            if code is not None:
                return code
            if pid and proc_ctime(pid) is None:
                try:  # reap our own child; a previous daemon's is reaped by init
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
                return read_exit(exit_file) if read_exit(exit_file) is not None else -1
            time.sleep(0.05)  # a real process: real time passes while it runs
        return None

    def _log_tail(self) -> str:
        try:
            with open(self.dir / "stop-action.log", "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 400))
                return f.read().decode("utf-8", "replace").strip().replace("\n", " | ")[-300:]
        except OSError:
            return ""

    def _action_failed(self, rec: StopRecord, msg: str, wall: float, mono: float) -> None:
        move(rec, P.FINAL_SYNC)  # sync again (cheap when nothing changed) before the next try
        rec.last_error = f"stop action failed: {msg}"
        rec.next_try_mono = mono + self.cfg.retry_interval
        rec.note(wall, rec.last_error)
        self.save()
        log.error("stop_action_failed", id=rec.id, action=rec.action, error=msg)

    def _done(self, rec: StopRecord, result: str, wall: float, mono: float) -> None:
        move(rec, P.DONE)
        rec.result, rec.done_at, rec.done_mono, rec.last_error = result, wall, mono, ""
        rec.note(wall, result)
        self.save()
        log.warning("stop_action_done", id=rec.id, action=rec.action, result=result)

    def _rec(self) -> StopRecord:
        if self.rec is None:
            raise RuntimeError("no stop in progress")
        return self.rec
