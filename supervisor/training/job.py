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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil
import structlog

from supervisor import records
from supervisor.clock import boot_id
from supervisor.config import TrainingConfig
from supervisor.context import Context
from supervisor.interfaces import Duty, TrainingInfo
from supervisor.notify.mails import training as words
from supervisor.proc import ExitWatch, descendants, start_time
from supervisor.redact import registered
from supervisor.statefile import atomic_write, set_aside
from supervisor.states import TRAINING_ALIVE, TrainingState, check_training_move
from supervisor.training.jobenv import job_env
from supervisor.training.runner import RESUME_ENV, RUNNER_MODULES, ExitRecord, RunSpec
from supervisor.training.safeopen import user_ids
from supervisor.training.tmux import Tmux, TmuxError

log = structlog.get_logger("training")

S = TrainingState


class TrainingError(Exception):
    """A request about the training that cannot be done now; the message says why."""


STOP_PHASES = ("SIGINT", "SIGTERM", "SIGKILL")


@dataclass(frozen=True)
class TrainingDoc:
    """training.json: what this daemon knows about the current (or last) run."""

    state: TrainingState = TrainingState.STOPPED
    run_id: int = 0                       # increments with every start
    restarts: int = 0                     # automatic restarts of this run so far (restart = on-failure)
    command: str | None = None
    adhoc: bool = False                   # started by `run -- CMD`, not training.command
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    run_dir: str | None = None            # runs/N: the runner's spec, pid and exit record
    log: str | None = None
    workdir: str | None = None
    boot_id: str | None = None            # the boot the run was started in
    stop_requested: bool = False
    stop_phase: str | None = None         # the last signal sent by a requested stop
    stop_sent_at: float | None = None
    stop_grace_s: float | None = None     # this stop's wait per signal, when shorter than training.stop_grace
    child_pid: int | None = None          # the job's shell
    runner_pid: int | None = None         # supervisor.training.runner in the tmux pane ...
    runner_ctime: float | None = None     # ... and its start time, so a reused PID is never taken for it
    restarting: bool = False
    next_restart_at: float | None = None
    note: str = ""
    autostart_boot_id: str | None = None  # training.autostart ran in this boot

    def __post_init__(self) -> None:
        for name in ("child_pid", "runner_pid"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"training.json: {name} should be a positive process id, got {v}")
        for name in ("run_id", "restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"training.json: {name} should not be negative, got {getattr(self, name)}")
        if self.stop_phase is not None and self.stop_phase not in STOP_PHASES:
            raise ValueError(f"training.json: stop_phase should be one of {', '.join(STOP_PHASES)}, "
                             f"got {self.stop_phase!r:.40}")

    @classmethod
    def from_json(cls, d: object) -> TrainingDoc:
        """ValueError naming the field when `d` is not a document this code wrote."""
        if isinstance(d, dict) and "state" not in d:
            raise ValueError("training.json: state missing")
        return records.load(cls, d, "training.json")

    def to_json(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        return d


class Training:
    """Owns training.json. All changes go through `_move`, under one lock."""

    def __init__(self, ctx: Context, conf: TrainingConfig, on_start: Callable[[TrainingInfo], None] | None = None,
                 on_end: Callable[[TrainingInfo], None] | None = None,
                 before_start: Callable[[], None] | None = None,
                 extra_env: Callable[[], dict[str, str]] = dict,
                 gate: Callable[[Callable[[], dict]], dict] | None = None):
        self.ctx = ctx
        # asked before every start (control, autostart, automatic restart); raising TrainingError
        # refuses the start with its message (the GPU health preflight with health.on_bad = "refuse")
        self.before_start = before_start
        self.cfg = conf
        self.state_dir = ctx.state_dir
        self.tmux = Tmux(self.state_dir / "tmux.sock")
        self.on_start = on_start
        self.on_end = on_end
        # the resume wing's, handed in by the daemon: env for every start (TRAIN_SUPERVISOR_RESUME_FROM),
        # and what autostart goes through (a restore from the target before the start)
        self.extra_env = extra_env
        self.withheld_env: list[str] = []   # names the last start kept from the job (they held our secrets)
        self.gate: Callable[[Callable[[], dict]], dict] = gate or (lambda start: start())
        self._lock = threading.RLock()
        self._runner = ExitWatch()  # the runner, asked every second
        self._pids_memo: tuple[int, float, float, frozenset[int]] | None = None
        self.doc = self._load()

    # --- persistence ------------------------------------------------------------------------
    def _load(self) -> TrainingDoc:
        raw = self.ctx.store.load("training", None)
        if raw is None:
            return TrainingDoc()
        try:
            return TrainingDoc.from_json(raw)
        except ValueError as e:
            # never guess from a damaged record (a live job judged by a string run_id): set it aside
            # and rebuild from what is really there, the tmux session and the runner's spec
            aside = set_aside(self.ctx.store.path("training"))
            self.ctx.store.problems.append(f"{e}; set aside as {aside.name}, re-adopting the training from tmux")
            log.error("training_state_unusable", error=str(e), set_aside=str(aside))
            return TrainingDoc()

    def _save(self) -> None:
        try:
            self.ctx.store.save("training", self.doc.to_json())
        except OSError as e:
            log.error("training_state_save_failed", error=str(e))

    def _set(self, **fields) -> None:
        """Change fields other than the state (which only `_move` changes), and save."""
        self.doc = replace(self.doc, **fields)
        self._save()

    @property
    def state(self) -> TrainingState:
        return self.doc.state

    def _move(self, new: TrainingState, **fields) -> None:
        check_training_move(self.state, new)
        old = self.state
        self.doc = replace(self.doc, state=new, **fields)
        self._save()
        if old != new:
            log.info("training_state", old=old.value, new=new.value, run_id=self.doc.run_id,
                     **{k: v for k, v in fields.items() if k in ("exit_code", "signal", "child_pid")})

    # --- views ------------------------------------------------------------------------------
    def log_path(self) -> str:
        return self.doc.log or self.cfg.log or str(self.state_dir / "train.log")

    def info(self) -> TrainingInfo:
        with self._lock:
            d = self.doc
            return TrainingInfo(
                state=d.state, pid=d.child_pid, started_at=d.started_at, ended_at=d.ended_at,
                exit_code=d.exit_code, signal=d.signal, restarts=d.restarts,
                command=d.command or self.cfg.command, log_path=self.log_path(),
                workdir=d.workdir or self.cfg.workdir, session=self.cfg.session, run_id=d.run_id,
            )

    def status(self) -> dict:
        i = self.info()
        return {
            "state": i.state.value, "pid": i.pid if i.state in TRAINING_ALIVE else None,
            "started_at": i.started_at, "ended_at": i.ended_at, "exit_code": i.exit_code,
            "signal": i.signal, "restarts": i.restarts, "command": i.command, "log": i.log_path,
            "session": i.session, "tmux_socket": self.tmux.socket, "run_id": i.run_id,
            "stop_requested": self.doc.stop_requested, "note": self.doc.note,
            "env_withheld": list(self.withheld_env),
        }

    def pids(self) -> set[int]:
        """The runner and every process under it. Its callers (the idle guard's CPU probe, the stall
        watch, GPU attribution) fall due at the same instant: one answer serves them all for a second
        (a walk down /proc)."""
        with self._lock:
            rp = self.doc.runner_pid
            if self.state not in TRAINING_ALIVE or not rp or not self._runner_alive():
                return set()
            # fresh after a second by the real clock and by the injected one (a test moving a
            # FakeClock sees every change at once)
            real, now = time.monotonic(), self.ctx.clock.monotonic()
            memo = self._pids_memo
            if memo is not None and memo[0] == rp and 0 <= real - memo[1] < 1.0 and 0 <= now - memo[2] < 1.0:
                return set(memo[3])
            kids = _tree_under(rp)
            if kids is None:
                return set()
            found = {rp} | kids
            self._pids_memo = (rp, real, now, frozenset(found))
            return found

    # --- lifecycle --------------------------------------------------------------------------
    def adopt(self) -> None:
        """At daemon start: reconcile with what is really running. Never starts or kills a job."""
        with self._lock:
            if self.state not in TRAINING_ALIVE and self.tmux.has_session(self.cfg.session):
                self._adopt_from_tmux()
            if self.state in TRAINING_ALIVE:
                if self._runner_alive():
                    log.info("training_adopted", run_id=self.doc.run_id, pid=self.doc.child_pid)
                elif self.doc.boot_id and self.doc.boot_id != boot_id():
                    # the machine rebooted under the job: it is gone, and this was no decision of
                    # the job's, so on_finish must not fire for it
                    self._move(S.STOPPED, note="the machine rebooted while this run was active",
                               ended_at=None, stop_requested=False)
                    return
            self.poll(adopting=True)

    def _adopt_from_tmux(self) -> None:
        """training.json was lost or damaged but our session is there: rebuild from the runner's spec."""
        pid = self.tmux.pane_pid(self.cfg.session)
        try:
            cmdline = psutil.Process(pid).cmdline() if pid else []
        except psutil.Error:
            cmdline = []
        if len(cmdline) >= 4 and cmdline[-2] in RUNNER_MODULES:
            try:
                spec = RunSpec.read(cmdline[-1])
            except (OSError, ValueError) as e:
                log.error("training_spec_unusable", path=cmdline[-1], error=str(e))
            else:
                self.doc = replace(self.doc, state=S.RUNNING, run_id=spec.run_id, command=spec.command,
                                   adhoc=spec.command != self.cfg.command, runner_pid=pid,
                                   runner_ctime=start_time(pid), run_dir=spec.run_dir, log=spec.log,
                                   workdir=spec.workdir, boot_id=boot_id(), started_at=spec.started_at)
                self.doc = replace(self.doc, child_pid=self._child_pid())
                self._save()
                log.warning("training_readopted_from_tmux", pid=pid, run_id=spec.run_id)
                return
        log.warning("foreign_tmux_session", session=self.cfg.session,
                    hint="a session with the training's name exists but was not started by us")

    def _runner_alive(self) -> bool:
        return self._runner.alive(self.doc.runner_pid, self.doc.runner_ctime)

    def start(self, command: str | None = None, adhoc: bool = False, cwd: str | None = None,
              env: dict[str, str] | None = None) -> dict:
        """Start the training. `cwd`/`env`: `supervisorctl run` from a user's shell, which runs the
        command where and as that shell would (env is their whole environment); a restart of such
        a run (restart = on-failure, `restart`, after a daemon restart) reuses its spec's."""
        if self.before_start is not None and self.state not in TRAINING_ALIVE:
            self.before_start()
        with self._lock:
            if self.state in TRAINING_ALIVE:
                raise TrainingError(f"training is already {self.state.value} (pid {self.doc.child_pid}); "
                                    "stop it first")
            if self.tmux.has_session(self.cfg.session) and self._exit_recorded() and \
                    self.tmux.pane_pid(self.cfg.session) == self.doc.runner_pid:
                self.tmux.kill_session(self.cfg.session)  # our previous run's pane, closing
            if self.tmux.has_session(self.cfg.session):
                raise TrainingError(f"a tmux session named {self.cfg.session!r} already exists on "
                                    f"{self.tmux.socket}; not starting a second copy")
            cmd = command if command is not None else (self.doc.command if self.doc.adhoc else self.cfg.command)
            if not cmd or not cmd.strip():
                raise TrainingError("no training command: set training.command in the config, "
                                    "or use `supervisorctl run -- CMD`")
            if adhoc and cwd is None and env is None:
                prev = prev_spec(self.doc)
                if prev is not None and prev.env_exact and prev.command == cmd:
                    cwd, env = prev.workdir, dict(prev.env)
            workdir = cwd or self.cfg.workdir or None
            if workdir and not os.path.isdir(workdir):
                what = "the folder `run` was called in" if cwd else "training.workdir"
                raise TrainingError(f"{what} {workdir} does not exist")
            run_id = next_run_id(self.state_dir, self.doc)
            run_dir = self.state_dir / "runs" / str(run_id)
            run_dir.mkdir(parents=True, exist_ok=True)
            now = self.ctx.clock.time()
            # the caller's environment (`run` from a shell) wins over training.env: it is what their shell
            # would run with; what the daemon adds (the resume hint) is its own answer, never the caller's
            spec = RunSpec(run_id=run_id, command=cmd, shell=self.cfg.shell, workdir=workdir, env=self._env(env),
                           log=self.cfg.log or str(self.state_dir / "train.log"), user=self.cfg.user or None,
                           run_dir=str(run_dir), started_at=now, env_exact=env is not None, env_whole=True)
            spec_path = run_dir / "spec.json"
            atomic_write(spec_path, json.dumps(spec.to_json()).encode(), 0o600)  # holds the env's secrets
            restarts = self.doc.restarts if self.doc.restarting else 0
            self._move(S.STARTING, run_id=run_id, command=cmd, adhoc=adhoc, started_at=now, ended_at=None,
                       exit_code=None, signal=None, run_dir=str(run_dir), log=spec.log, workdir=workdir,
                       boot_id=boot_id(), stop_requested=False, child_pid=None, runner_pid=None,
                       restarts=restarts, restarting=False, next_restart_at=None, note="", stop_phase=None,
                       stop_grace_s=None)
            argv = [sys.executable, "-m", RUNNER_MODULES[0], str(spec_path)]
            try:
                self.tmux.new_session(self.cfg.session, argv, workdir,
                                      scope_unit=f"train-supervisor-run-{run_id}-{int(now)}")
                rp = self.tmux.pane_pid(self.cfg.session)
            except TmuxError as e:
                self._move(S.FAILED, exit_code=None, signal=None, ended_at=now, note=str(e))
                raise TrainingError(str(e)) from None
            self._set(runner_pid=rp, runner_ctime=start_time(rp))
            log.info("training_started", run_id=run_id, command=cmd, runner_pid=rp)
        if self.on_start:
            self._safe(self.on_start, self.info())
        self.poll()
        return self.status()

    def _env(self, caller: dict[str, str] | None = None) -> dict[str, str]:
        env, self.withheld_env = start_env(self.cfg, self.extra_env, caller)
        return env

    def stop(self, grace: float | None = None) -> dict:
        """SIGINT, then SIGTERM, then SIGKILL, each after `grace` (training.stop_grace unless a
        shorter one is asked: a run hung in a collective with a lost node ignores SIGINT)."""
        with self._lock:
            if self.state not in TRAINING_ALIVE:
                raise TrainingError(f"training is not running ({self.state.value})")
            if self.state != S.STOPPING:
                self._move(S.STOPPING, stop_requested=True, stop_phase="SIGINT",
                           stop_sent_at=self.ctx.clock.time(), stop_grace_s=grace)
                self._signal_group(signal.SIGINT)
        return self.status()

    def restart(self) -> dict:
        if self.state in TRAINING_ALIVE:
            self.stop()
            if not self.wait_ended(timeout=self.cfg.stop_grace * 3 + 10):
                raise TrainingError("training did not stop in time; not restarting")
        return self.start(command=self.doc.command if self.doc.adhoc else None, adhoc=self.doc.adhoc)

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
            if self.doc.autostart_boot_id == boot_id() or self.state in TRAINING_ALIVE:
                return
            self._set(autostart_boot_id=boot_id())
        try:
            self.gate(self.start)
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
            elif st == S.FAILED and self.doc.next_restart_at is not None and \
                    self.ctx.clock.time() >= self.doc.next_restart_at:
                self.doc = replace(self.doc, restarting=True, restarts=self.doc.restarts + 1)
                try:
                    self.start(command=self.doc.command if self.doc.adhoc else None, adhoc=self.doc.adhoc)
                except TrainingError as e:
                    self._set(next_restart_at=None, note=f"restart failed: {e}")
        if ended is not None and self.on_end:
            self._safe(self.on_end, ended)

    def _exit_recorded(self) -> bool:
        return bool(self.doc.run_dir) and os.path.exists(os.path.join(self.doc.run_dir, "exit.json"))

    def _child_pid(self) -> int | None:
        if not self.doc.run_dir:
            return None
        try:
            txt = (Path(self.doc.run_dir) / "pid").read_text().strip()
            return int(txt) if txt.isdigit() and int(txt) > 0 else None
        except OSError:
            return None

    def _finish(self) -> TrainingInfo | None:
        """The runner is gone: read how the job ended and settle the state."""
        run_dir = Path(self.doc.run_dir or "/nonexistent")
        rec: ExitRecord | None = None
        try:
            rec = ExitRecord.read(run_dir / "exit.json")
        except FileNotFoundError:
            rec = None
        except (OSError, ValueError) as e:
            log.error("training_exit_record_unusable", run_dir=str(run_dir), error=str(e))
            rec = None
        now = self.ctx.clock.time()
        code = rec.exit_code if rec else None
        sig = rec.signal if rec else None
        ended_at = rec.ended_at if rec and rec.ended_at is not None else now
        note = ""
        if rec is None:
            if self.doc.stop_phase == "SIGKILL":
                code, sig = -9, "SIGKILL"
            else:
                note = "the runner vanished without recording an exit status"
        child = self.doc.child_pid or self._child_pid()
        if self.doc.stop_requested:
            self._move(S.STOPPED, exit_code=code, signal=sig, ended_at=ended_at, note=note, child_pid=child)
            return None
        new = S.FINISHED if code == 0 else S.FAILED
        self._move(new, exit_code=code, signal=sig, ended_at=ended_at, note=note, child_pid=child)
        if new == S.FAILED and self.cfg.restart == "on-failure" and self.doc.restarts < self.cfg.max_restarts:
            delay = self.cfg.restart_backoff * (2 ** self.doc.restarts)
            self._set(next_restart_at=now + delay)
            log.warning("training_will_restart", in_s=delay, restarts=self.doc.restarts)
            info = self.info()
            mail = words.restarted(info.exit_code, info.signal, delay, info.command, info.log_path)
            self.ctx.alerts.event(f"training:restart:{info.run_id}", "training_restarted", "warning",
                                  mail.subject, mail.body)
            return None
        return self.info()

    def _escalate(self) -> None:
        now = self.ctx.clock.time()
        sent = self.doc.stop_sent_at or now
        phase = self.doc.stop_phase
        grace = min(self.cfg.stop_grace, self.doc.stop_grace_s or self.cfg.stop_grace)
        if phase == "SIGINT" and now - sent >= grace:
            self._set(stop_phase="SIGTERM", stop_sent_at=now)
            self._signal_group(signal.SIGTERM)
        elif phase == "SIGTERM" and now - sent >= grace:
            self._set(stop_phase="SIGKILL", stop_sent_at=now)
            self._kill_job_tree()

    def send_signal(self, sig: signal.Signals) -> str:
        """Send `sig` to the job's process group (a spot notice asks it to save now). "" when sent,
        else why not."""
        with self._lock:
            rp = self.doc.runner_pid
            alive = self.state in TRAINING_ALIVE and bool(rp) and self._runner_alive()
        return signal_group(rp, sig, why="preemption") if alive and rp else "no training is running"

    def _signal_group(self, sig: signal.Signals) -> None:
        rp = self.doc.runner_pid
        if rp and self._runner_alive() and (err := signal_group(rp, sig)):
            log.warning("training_signal_failed", signal=sig.name, error=err)

    def _kill_job_tree(self) -> None:
        if self.doc.runner_pid:
            kill_below(self.doc.runner_pid)

    def _safe(self, fn: Callable[[TrainingInfo], None], info: TrainingInfo) -> None:
        try:
            fn(info)
        except Exception:  # noqa: BLE001 - a listener's bug must not break the job's bookkeeping
            log.exception("training_listener_failed", listener=getattr(fn, "__qualname__", str(fn)))

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("training", 1.0, self.poll),)


def signal_group(runner_pid: int, sig: signal.Signals, why: str | None = None) -> str:
    """`sig` to the runner's process group: "" when sent, else why not."""
    log.info("training_signal", signal=sig.name, pgid=runner_pid, **({"why": why} if why else {}))
    try:
        os.killpg(os.getpgid(runner_pid), sig)
    except (ProcessLookupError, PermissionError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def kill_below(runner_pid: int) -> None:
    """SIGKILL the job and its descendants but not the runner, which must live to record it."""
    try:
        procs = psutil.Process(runner_pid).children(recursive=True)
    except psutil.Error:
        return
    log.warning("training_sigkill", pids=[p.pid for p in procs])
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def command_line(argv: list[str]) -> str:
    """`supervisorctl run -- a b 'c d'` as one shell command line."""
    return argv[0] if len(argv) == 1 else shlex.join(argv)


def prev_spec(doc: TrainingDoc) -> RunSpec | None:
    """The spec of the last run (a `run` from a shell is restarted where and as it was started)."""
    if not doc.run_dir:
        return None
    try:
        return RunSpec.read(Path(doc.run_dir) / "spec.json")
    except (OSError, ValueError):
        return None


def next_run_id(state_dir: Path, doc: TrainingDoc) -> int:
    """One above any run this state_dir has seen: a training.json set aside must not make a new
    run reuse an old run's folder (its exit record would end the new run at once)."""
    seen = [int(p.name) for p in (state_dir / "runs").glob("*") if p.name.isdigit()]
    return max([doc.run_id, *seen]) + 1


def _tree_under(pid: int) -> set[int] | None:
    """Every process under `pid` (a few reads down /proc; psutil where the kernel lacks them);
    None when it is gone."""
    kids = descendants(pid)
    if kids is None:
        try:
            kids = {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            return None
    return kids


def start_env(cfg: TrainingConfig, extra_env: Callable[[], dict[str, str]],
              caller: dict[str, str] | None) -> tuple[dict[str, str], list[str]]:
    """The job's whole environment (jobenv): the caller's or a few harmless names of ours,
    training.pass_env, what the daemon adds, training.env; never a secret of the daemon's. With the
    names withheld."""
    try:
        extra = extra_env()
    except Exception as e:  # noqa: BLE001 - a start never fails for want of a hint
        log.warning("training_env_hook_failed", error=str(e))
        extra = {}
    ids = user_ids(cfg.user) if cfg.user else None
    other = ids is not None and ids[0] != os.geteuid()
    env, withheld = job_env(os.environ, caller=caller, config_env=cfg.env, extra=extra, pass_env=cfg.pass_env,
                            secrets=_daemon_secrets(), as_other_user=other, reserved=(RESUME_ENV,))
    if withheld:
        log.warning("training_env_withheld", names=withheld,
                    note="each holds a secret of the daemon's; name it in training.pass_env to pass it")
    return env, withheld


def _daemon_secrets() -> set[str]:
    """Every value registered as a secret, and the credentials the daemon's environment holds
    whose names alone do not say secret (an AWS key id is half of the pair)."""
    out = set(registered())
    out.update(v for k in ("AWS_ACCESS_KEY_ID",) if (v := os.environ.get(k, "").strip()))
    return out

