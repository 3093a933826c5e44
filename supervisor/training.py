"""The training job: started in a named tmux session, watched, stopped, re-adopted after a restart.

The truth about a run lives in three places that all survive the daemon: the tmux session, the
runner process in it (identified by PID *and* start time, so a recycled PID is never mistaken for
the job), and the run folder where the runner writes the job's PID and, at the end, its exit
status. `training.json` in state_dir ties them together. A new daemon reconciles these instead of
starting anything, so a crash, `kill -9` or upgrade never starts a second copy and never kills it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import structlog

from .clock import boot_id
from .context import Context
from .interfaces import TrainingInfo
from .statefile import atomic_write
from .states import TRAINING_ALIVE, TrainingState, check_training_move
from .tmux import Tmux, TmuxError

log = structlog.get_logger("training")

S = TrainingState


class TrainingError(Exception):
    """A request about the training that cannot be done now; the message says why."""


def _proc_ctime(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


class Training:
    """Owns training.json. All changes go through `_move`, under one lock."""

    def __init__(self, ctx: Context, on_start: Callable[[TrainingInfo], None] | None = None,
                 on_end: Callable[[TrainingInfo], None] | None = None):
        self.ctx = ctx
        self.cfg = ctx.config.training
        self.state_dir = Path(ctx.config.state_dir)
        self.tmux = Tmux(self.state_dir / "tmux.sock")
        self.on_start = on_start
        self.on_end = on_end
        self._lock = threading.RLock()
        self.doc: dict = self._load()

    # --- persistence ------------------------------------------------------------------------
    def _load(self) -> dict:
        doc = self.ctx.store.load("training", None)
        if not isinstance(doc, dict) or doc.get("state") not in S.__members__:
            if doc is not None:
                self.ctx.store.problems.append("training.json: unusable contents; re-adopting from tmux")
            doc = {"state": "STOPPED", "run_id": 0, "restarts": 0}
        return doc

    def _save(self) -> None:
        try:
            self.ctx.store.save("training", self.doc)
        except OSError as e:
            log.error("training_state_save_failed", error=str(e))

    @property
    def state(self) -> TrainingState:
        return S(self.doc["state"])

    def _move(self, new: TrainingState, **fields) -> None:
        check_training_move(self.state, new)
        old = self.state
        self.doc.update(fields)
        self.doc["state"] = new.value
        self._save()
        if old != new:
            log.info("training_state", old=old.value, new=new.value, run_id=self.doc.get("run_id"),
                     **{k: v for k, v in fields.items() if k in ("exit_code", "signal", "pid")})

    # --- views ------------------------------------------------------------------------------
    def log_path(self) -> str:
        return self.doc.get("log") or self.cfg.log or str(self.state_dir / "train.log")

    def info(self) -> TrainingInfo:
        with self._lock:
            d = self.doc
            return TrainingInfo(
                state=self.state, pid=d.get("child_pid"),
                started_at=d.get("started_at"), ended_at=d.get("ended_at"), exit_code=d.get("exit_code"),
                signal=d.get("signal"), restarts=d.get("restarts", 0),
                command=d.get("command") or self.cfg.command, log_path=self.log_path(),
                workdir=d.get("workdir") or self.cfg.workdir, session=self.cfg.session,
                run_id=d.get("run_id", 0),
            )

    def status(self) -> dict:
        i = self.info()
        return {
            "state": i.state.value, "pid": i.pid if i.state in TRAINING_ALIVE else None,
            "started_at": i.started_at, "ended_at": i.ended_at, "exit_code": i.exit_code,
            "signal": i.signal, "restarts": i.restarts, "command": i.command, "log": i.log_path,
            "session": i.session, "tmux_socket": self.tmux.socket, "run_id": i.run_id,
            "stop_requested": bool(self.doc.get("stop_requested")), "note": self.doc.get("note", ""),
        }

    def pids(self) -> set[int]:
        with self._lock:
            rp = self.doc.get("runner_pid")
            if self.state not in TRAINING_ALIVE or not self._runner_alive():
                return set()
        try:
            p = psutil.Process(rp)
            return {rp} | {c.pid for c in p.children(recursive=True)}
        except psutil.Error:
            return set()

    def attached_clients(self) -> list[str]:
        return self.tmux.list_clients(self.cfg.session)

    # --- lifecycle --------------------------------------------------------------------------
    def adopt(self) -> None:
        """At daemon start: reconcile with what is really running. Never starts or kills a job."""
        with self._lock:
            if self.state not in TRAINING_ALIVE and self.tmux.has_session(self.cfg.session):
                self._adopt_from_tmux()
            if self.state in TRAINING_ALIVE:
                if self._runner_alive():
                    log.info("training_adopted", run_id=self.doc.get("run_id"), pid=self.doc.get("child_pid"))
                elif self.doc.get("boot_id") and self.doc.get("boot_id") != boot_id():
                    # the machine rebooted under the job: it is gone, and this was no decision of
                    # the job's, so on_finish must not fire for it
                    self._move(S.STOPPED, note="the machine rebooted while this run was active",
                               ended_at=None, stop_requested=False)
                    return
            self.poll(adopting=True)

    def _adopt_from_tmux(self) -> None:
        """training.json was lost or corrupt but our session is there: rebuild from the runner's spec."""
        pid = self.tmux.pane_pid(self.cfg.session)
        try:
            cmdline = psutil.Process(pid).cmdline() if pid else []
        except psutil.Error:
            cmdline = []
        if len(cmdline) >= 4 and cmdline[-2] == "supervisor.runner":
            try:
                spec = json.loads(Path(cmdline[-1]).read_text())
            except (OSError, json.JSONDecodeError):
                spec = None
            if spec:
                self.doc.update(state="RUNNING", run_id=spec.get("run_id", 0), command=spec["command"],
                                runner_pid=pid, runner_ctime=_proc_ctime(pid), run_dir=spec["run_dir"],
                                log=spec["log"], workdir=spec.get("workdir"), boot_id=boot_id(),
                                started_at=spec.get("started_at"))
                self._save()
                log.warning("training_readopted_from_tmux", pid=pid, run_id=spec.get("run_id"))
                return
        log.warning("foreign_tmux_session", session=self.cfg.session,
                    hint="a session with the training's name exists but was not started by us")

    def _runner_alive(self) -> bool:
        pid = self.doc.get("runner_pid")
        ctime = _proc_ctime(pid)
        want = self.doc.get("runner_ctime")
        if ctime is None:
            return False
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
        return want is None or abs(ctime - want) < 1.0

    def start(self, command: str | None = None, adhoc: bool = False) -> dict:
        with self._lock:
            if self.state in TRAINING_ALIVE:
                raise TrainingError(f"training is already {self.state.value} (pid {self.doc.get('child_pid')}); "
                                    "stop it first")
            if self.tmux.has_session(self.cfg.session) and self._exit_recorded() and \
                    self.tmux.pane_pid(self.cfg.session) == self.doc.get("runner_pid"):
                self.tmux.kill_session(self.cfg.session)  # our previous run's pane, closing
            if self.tmux.has_session(self.cfg.session):
                raise TrainingError(f"a tmux session named {self.cfg.session!r} already exists on "
                                    f"{self.tmux.socket}; not starting a second copy")
            cmd = command if command is not None else (self.doc.get("command") if self.doc.get("adhoc")
                                                       else self.cfg.command)
            if not cmd or not cmd.strip():
                raise TrainingError("no training command: set training.command in the config, "
                                    "or use `supervisorctl run -- CMD`")
            workdir = self.cfg.workdir or None
            if workdir and not os.path.isdir(workdir):
                raise TrainingError(f"training.workdir {workdir} does not exist")
            run_id = int(self.doc.get("run_id", 0)) + 1
            run_dir = self.state_dir / "runs" / str(run_id)
            run_dir.mkdir(parents=True, exist_ok=True)
            now = self.ctx.clock.time()
            spec = {"run_id": run_id, "command": cmd, "shell": self.cfg.shell, "workdir": workdir,
                    "env": self.cfg.env, "log": self.cfg.log or str(self.state_dir / "train.log"),
                    "user": self.cfg.user or None, "run_dir": str(run_dir), "started_at": now}
            spec_path = run_dir / "spec.json"
            atomic_write(spec_path, json.dumps(spec).encode(), 0o644)
            restarts = self.doc.get("restarts", 0) if self.doc.get("restarting") else 0
            self._move(S.STARTING, run_id=run_id, command=cmd, adhoc=adhoc, started_at=now, ended_at=None,
                       exit_code=None, signal=None, run_dir=str(run_dir), log=spec["log"], workdir=workdir,
                       boot_id=boot_id(), stop_requested=False, child_pid=None, runner_pid=None,
                       restarts=restarts, restarting=False, next_restart_at=None, note="", stop_phase=None)
            argv = [sys.executable, "-m", "supervisor.runner", str(spec_path)]
            try:
                self.tmux.new_session(self.cfg.session, argv, workdir,
                                      scope_unit=f"train-supervisor-run-{run_id}-{int(now)}")
                rp = self.tmux.pane_pid(self.cfg.session)
            except TmuxError as e:
                self._move(S.FAILED, exit_code=None, signal=None, ended_at=now, note=str(e))
                raise TrainingError(str(e)) from None
            self.doc.update(runner_pid=rp, runner_ctime=_proc_ctime(rp))
            self._save()
            log.info("training_started", run_id=run_id, command=cmd, runner_pid=rp)
        if self.on_start:
            self._safe(self.on_start, self.info())
        self.poll()
        return self.status()

    def stop(self) -> dict:
        with self._lock:
            if self.state not in TRAINING_ALIVE:
                raise TrainingError(f"training is not running ({self.state.value})")
            if self.state != S.STOPPING:
                self._move(S.STOPPING, stop_requested=True, stop_phase="SIGINT",
                           stop_sent_at=self.ctx.clock.time())
                self._signal_group(signal.SIGINT)
        return self.status()

    def restart(self) -> dict:
        if self.state in TRAINING_ALIVE:
            self.stop()
            if not self.wait_ended(timeout=self.cfg.stop_grace * 3 + 10):
                raise TrainingError("training did not stop in time; not restarting")
        return self.start(command=self.doc.get("command") if self.doc.get("adhoc") else None,
                          adhoc=bool(self.doc.get("adhoc")))

    def wait_ended(self, timeout: float) -> bool:
        """Real-time wait used by restart; polls the job directly, not the scheduler."""
        import time as _t

        deadline = _t.monotonic() + timeout
        while _t.monotonic() < deadline:
            self.poll()
            if self.state not in TRAINING_ALIVE:
                return True
            _t.sleep(0.2)
        return False

    def maybe_autostart(self) -> None:
        """training.autostart: once per boot, so a crash-looping daemon never starts it twice."""
        if not self.cfg.autostart:
            return
        with self._lock:
            if self.doc.get("autostart_boot_id") == boot_id() or self.state in TRAINING_ALIVE:
                return
            self.doc["autostart_boot_id"] = boot_id()
            self._save()
        try:
            self.start()
        except TrainingError as e:
            log.error("autostart_failed", error=str(e))

    # --- the periodic check -----------------------------------------------------------------
    def poll(self, adopting: bool = False) -> None:
        ended: TrainingInfo | None = None
        with self._lock:
            st = self.state
            if st in TRAINING_ALIVE:
                # the exit record is written the moment the job ends; the runner lingers a few ms
                if self._runner_alive() and not self._exit_recorded():
                    if st == S.STARTING:
                        cp = self._child_pid()
                        if cp:
                            self._move(S.RUNNING, child_pid=cp)
                    if self.state == S.STOPPING:
                        self._escalate()
                else:
                    ended = self._finish()
            elif st == S.FAILED and self.doc.get("next_restart_at") and \
                    self.ctx.clock.time() >= self.doc["next_restart_at"]:
                self.doc.update(restarting=True, restarts=self.doc.get("restarts", 0) + 1)
                try:
                    self.start(command=self.doc.get("command") if self.doc.get("adhoc") else None,
                               adhoc=bool(self.doc.get("adhoc")))
                except TrainingError as e:
                    self.doc.update(next_restart_at=None, note=f"restart failed: {e}")
                    self._save()
        if ended is not None and self.on_end:
            self._safe(self.on_end, ended)

    def _exit_recorded(self) -> bool:
        return bool(self.doc.get("run_dir")) and (Path(self.doc["run_dir"]) / "exit.json").exists()

    def _child_pid(self) -> int | None:
        try:
            txt = (Path(self.doc["run_dir"]) / "pid").read_text().strip()
            return int(txt) if txt.isdigit() else None
        except (OSError, KeyError, TypeError):
            return None

    def _finish(self) -> TrainingInfo | None:
        """The runner is gone: read how the job ended and settle the state."""
        run_dir = Path(self.doc.get("run_dir") or "/nonexistent")
        rec = None
        try:
            rec = json.loads((run_dir / "exit.json").read_text())
        except (OSError, json.JSONDecodeError):
            rec = None
        now = self.ctx.clock.time()
        code = rec.get("exit_code") if isinstance(rec, dict) else None
        sig = rec.get("signal") if isinstance(rec, dict) else None
        ended_at = rec.get("ended_at", now) if isinstance(rec, dict) else now
        note = ""
        if rec is None:
            if self.doc.get("stop_phase") == "SIGKILL":
                code, sig = -9, "SIGKILL"
            else:
                note = "the runner vanished without recording an exit status"
        child = self.doc.get("child_pid") or self._child_pid()
        if self.doc.get("stop_requested"):
            self._move(S.STOPPED, exit_code=code, signal=sig, ended_at=ended_at, note=note, child_pid=child)
            return None
        new = S.FINISHED if code == 0 else S.FAILED
        self._move(new, exit_code=code, signal=sig, ended_at=ended_at, note=note, child_pid=child)
        if new == S.FAILED and self.cfg.restart == "on-failure" and \
                self.doc.get("restarts", 0) < self.cfg.max_restarts:
            delay = self.cfg.restart_backoff * (2 ** self.doc.get("restarts", 0))
            self.doc["next_restart_at"] = now + delay
            self._save()
            log.warning("training_will_restart", in_s=delay, restarts=self.doc.get("restarts", 0))
            info = self.info()
            self.ctx.alerts.event(f"training:restart:{info.run_id}", "training_restarted", "warning",
                                  f"training failed ({_describe(info)}); restarting in {int(delay)}s",
                                  f"Command: {info.command}\nLog: {info.log_path}\n")
            return None
        return self.info()

    def _escalate(self) -> None:
        now = self.ctx.clock.time()
        sent = self.doc.get("stop_sent_at") or now
        phase = self.doc.get("stop_phase")
        grace = self.cfg.stop_grace
        if phase == "SIGINT" and now - sent >= grace:
            self.doc.update(stop_phase="SIGTERM", stop_sent_at=now)
            self._save()
            self._signal_group(signal.SIGTERM)
        elif phase == "SIGTERM" and now - sent >= grace:
            self.doc.update(stop_phase="SIGKILL", stop_sent_at=now)
            self._save()
            self._kill_job_tree()

    def _signal_group(self, sig: signal.Signals) -> None:
        rp = self.doc.get("runner_pid")
        if not rp or not self._runner_alive():
            return
        log.info("training_signal", signal=sig.name, pgid=rp)
        try:
            os.killpg(os.getpgid(rp), sig)
        except (ProcessLookupError, PermissionError) as e:
            log.warning("training_signal_failed", signal=sig.name, error=str(e))

    def _kill_job_tree(self) -> None:
        """SIGKILL the job and its descendants but not the runner, which must live to record it."""
        rp = self.doc.get("runner_pid")
        try:
            procs = psutil.Process(rp).children(recursive=True)
        except psutil.Error:
            return
        log.warning("training_sigkill", pids=[p.pid for p in procs])
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass

    def _safe(self, fn: Callable[[TrainingInfo], None], info: TrainingInfo) -> None:
        try:
            fn(info)
        except Exception:  # noqa: BLE001 - a listener's bug must not break the job's bookkeeping
            log.exception("training_listener_failed", listener=getattr(fn, "__qualname__", str(fn)))


def _describe(info: TrainingInfo) -> str:
    if info.signal:
        return f"killed by {info.signal}"
    if info.exit_code is None:
        return "exit status unknown"
    return f"exit code {info.exit_code}"


def describe_end(info: TrainingInfo) -> str:
    return _describe(info)


def command_line(argv: list[str]) -> str:
    """`supervisorctl run -- a b 'c d'` as one shell command line."""
    return argv[0] if len(argv) == 1 else shlex.join(argv)


