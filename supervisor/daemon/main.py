"""train-supervisord: wires sensors, decisions and actions together and serves the control socket.

Data flows one way: sensors (NVML, log follower, activity probes, watcher) -> decisions (idle
machine, alert dedup, completeness, progress) -> actions (tmux, upload, email, stop) -> state.
Each periodic duty is an APScheduler job that never overlaps itself and coalesces after a stall;
a duty that raises is logged and tried again next time, never taking the others down.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from supervisor import __version__
from supervisor.clock import Clock, SystemClock
from supervisor.config import Config, ConfigError, load, nothing_watched
from supervisor.config.cluster import for_node
from supervisor.context import Context
from supervisor.daemon.channels import build_channels, register_secrets, status_aside
from supervisor.daemon.control import ControlServer, Peer, RequestError
from supervisor.daemon.malloc import few_arenas, settle_memory
from supervisor.daemon.systemd_notify import notify, watchdog_interval
from supervisor.daemon.wings import WINGS, Wing, build, default_hostname, duty_order
from supervisor.interfaces import Duty, HasDuties, HasStatus, HasVerbs, TrainingInfo, Verb
from supervisor.logging_setup import configure
from supervisor.notify.alerts import Alerts
from supervisor.notify.webhook import facts_for
from supervisor.requests import run_context
from supervisor.spot.decide import newest_unit
from supervisor.statefile import Reserve, StateStore, StateWriteError, secure_state_dir
from supervisor.states import TRAINING_ALIVE, TrainingState
from supervisor.status import Block
from supervisor.status.cluster import ClusterBlock
from supervisor.status.training import DaemonBlock, TrainingBlock
from supervisor.stop.resolve import choose, priced
from supervisor.training.job import TrainingError, command_line
from supervisor.training.runner import run_banner

log = structlog.get_logger("daemon")

# What a socket_group member (any peer but root and the daemon's own user) may ask: read and nudge.
# start/restart/run start a process as root; stop ends someone's training (and, with
# on_finish = "stop", stops the machine): those stay root's. A new command is root's until added here.
MEMBER_COMMANDS = frozenset({"ping", "status", "alerts", "keepalive", "sync", "health"})


class Daemon:
    """The house: the core's parts (config, clock, state store, alerts), then every wing of
    supervisor.daemon.wings built in the order their needs give; their duties, threads, status
    blocks and verbs are gathered from that one list."""

    def __init__(self, cfg: Config, clock: Clock | None = None, wings: tuple[Wing, ...] = WINGS):
        cfg, self.run_target = for_node(cfg, os.environ)  # a node of several syncs its part
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.started_at = self.clock.time()
        register_secrets(cfg)   # masked by value in every message from now on (supervisor.redact)
        # what stop.action means on this machine (the provider, what still bills), decided once;
        # the provider's own hourly price where the config sets none (issue 52)
        self.stop_plan = choose(cfg.stop)
        cfg = self.cfg = priced(cfg, self.stop_plan)
        dir_problems = secure_state_dir(cfg.state_dir, cfg.socket_group)
        self.store = StateStore(cfg.state_dir)
        for problem in dir_problems:
            self.store.problems.append(problem)
            log.error("state_dir_problem", problem=problem)
        # a few MiB the first write to hit a full disk frees: the stop record and alerts still fit
        self.reserve = Reserve(cfg.state_dir).register()
        self.reserve.arm()
        self.hostname = default_hostname(cfg.hostname)
        channels, self.channel_problems = build_channels(
            cfg, hostname=self.hostname, facts=lambda kind: facts_for(kind, self.fresh_status()))
        # the alerts are the core's: every wing's Context carries them (the list's "alerts" line shows them)
        alerts = Alerts(cfg.alerts, self.clock, cfg.state_dir, hostname=self.hostname, channels=channels,
                        on_alert=self.on_alert)
        self.alerts = alerts
        self.ctx = Context(self.clock, self.store, alerts)
        self.wing_list = wings
        self.built = build(self, wings)   # every wing, set on self by name, in build order
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(8)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60},
        )
        self.control = ControlServer(cfg.socket, self._handlers(), group=cfg.socket_group,
                                     member_commands=MEMBER_COMMANDS)
        self._stop = threading.Event()
        self._stop_again = threading.Event()  # a second signal while a preemption notice holds the exit
        self._stop_signal: int | None = None

    # --- wiring -------------------------------------------------------------------------------
    @staticmethod
    def metrics_wanted(c: Config) -> bool:
        """The metrics duty also keeps the snapshot a webhook body is built from."""
        return bool(c.metrics.textfile or c.metrics.listen or c.notify.webhook_url)

    def burn_first(self) -> bool:
        """With a burn-in, autostart waits for it: the run must not share the GPUs with the load test."""
        return bool(self.cfg.health.burn_in and self.cfg.training.autostart)

    def wings(self) -> list[object]:
        """Every wing on this machine, in the order of their status blocks (the list's order)."""
        return [w for w in (getattr(self, s.name) for s in self.wing_list) if w is not None]

    def duties(self) -> list[Duty]:
        """The wings' duties, by phase (what senses before what judges, the alerts after, so an
        alert raised this instant goes out this instant), then the daemon's own two."""
        return [*(d for s in duty_order(self.wing_list) if isinstance(w := getattr(self, s.name), HasDuties)
                  for d in w.duties()),
                Duty("reserve", 60.0, self.reserve.arm),  # armed again once space was freed
                Duty("watchdog", watchdog_interval(), lambda: notify("WATCHDOG=1", f"STATUS={self._status_line()}"))]

    def _every(self, duty: Duty) -> None:
        if not duty.every:
            return

        failing: list[str] = []  # the error it fails with now: its traceback is logged once, not every run

        def run() -> None:
            try:
                duty.run()
            except Exception as e:  # noqa: BLE001 - one failing duty must never stop the others
                said = f"{type(e).__name__}: {e}"[:300]
                if failing != [said]:
                    log.exception("duty_failed", duty=duty.name)
                    failing[:] = [said]
                return
            if failing:
                log.info("duty_recovered", duty=duty.name, was=failing[0])
                failing.clear()

        # every duty starts at the same instant, so duties whose periods divide one another fall due
        # together and the scheduler wakes once for all of them (once a second at rest, not 4 times)
        self.scheduler.add_job(run, "interval", seconds=max(duty.every, 0.2), id=duty.name, name=duty.name,
                               next_run_time=self._first_run)

    def on_training_start(self, info: TrainingInfo) -> None:
        self.follower.switch(info.log_path, start_at_end=True, since=run_banner(info.run_id))
        self.oom.reset(info.started_at or self.clock.time())
        self.progress.reset(self.clock.time())
        found = self.resume.local()
        self.progress.start_run(info.run_id, info.started_at or self.clock.time(), found[1] if found else None)
        self.guard.poll_soon()

    def on_training_end(self, info: TrainingInfo) -> None:
        # read what the job printed last (an OOM traceback) before judging how it ended
        self.follower.poll(self.clock.time())
        self.progress.end_run(info.run_id, info.ended_at or self.clock.time(), self.cfg.save_dirs)
        self.oom.check_exit(info)
        if self.cluster:
            self.cluster.beat_soon()
        self.sync.request_sync()
        self.guard.on_training_ended(info)
        self.guard.poll_soon()

    def hook_facts(self) -> dict[str, object]:
        """What every hook is told besides its event's own facts: the host, the target, and the newest
        checkpoint the target holds."""
        newest = newest_unit([h for h in self.sync.holdings() if h.on_target])
        return {"host": self.hostname, "target": getattr(self.sync, "display", "") or self.cfg.sync.target,
                "checkpoint": newest.unit if newest else ""}

    def on_alert(self, key: str, kind: str, severity: str, subject: str) -> None:
        hooks = getattr(self, "hooks", None)
        if hooks is None:
            return  # an alert raised while the daemon is still being built: no hook is wired yet
        if kind == "preemption":
            hooks.fire("preemption", {"reason": subject, "alert_key": key})
        if not kind.startswith("hook"):
            hooks.fire("alert", {"reason": subject, "alert_key": key, "alert_kind": kind, "severity": severity})

    def fresh_status(self, wait: float = 2.0) -> dict | None:
        metrics = getattr(self, "metrics", None)  # an alert raised while the wings are still being built
        return status_aside(self.status, wait) or (metrics.last_status if metrics else None)

    def run_rate(self) -> tuple[int | None, float | None]:
        """The current run and its step rate (the progress tracker's window): the health watch compares
        it with the rate at the run's start."""
        p = self.progress.snapshot(self.clock.time())
        return p.get("run_id"), p.get("steps_per_s")

    def start(self, schedule: bool = True) -> None:
        """Adopt, start the sync worker and the control socket, and schedule the duties (`schedule=False`:
        a test runs them itself, with a fake clock where hours pass)."""
        before = self.training.info()
        if before.state in TRAINING_ALIVE and before.started_at:
            self.oom.resume_run(before.started_at)  # also judges a run that ended while no daemon ran
        self.training.adopt()
        info = self.training.info()
        # no saved position (killed in the run's first seconds): read from the run's banner
        self.follower.switch(self.training.log_path(), start_at_end=True, since=run_banner(info.run_id))
        if info.state in (TrainingState.STARTING, TrainingState.RUNNING):
            self.progress.start_run(info.run_id, info.started_at or self.clock.time())
        for spec in self.built:  # the wings' threads, in build order (a wing starts after what it needs)
            if spec.start and (w := getattr(self, spec.name)) is not None:
                spec.start(self, w)
        self.control.start()
        c = self.cfg
        if schedule:
            self._first_run = _soon()
            for duty in self.duties():
                self._every(duty)
            self.scheduler.start()
        if not self.burn_first():
            self.training.maybe_autostart()
        notify("READY=1", f"STATUS={self._status_line()}")
        log.info("daemon_ready", version=__version__, pid=os.getpid(), config=c.source,
                 socket=c.socket, state_dir=c.state_dir)

    def run_forever(self) -> None:
        def on_signal(signum: int, _frame: object) -> None:
            if self._stop.is_set():
                self._stop_again.set()
            self._stop_signal = signum
            self._stop.set()

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, on_signal)
        _run_until(self._stop, lambda: (self.start(), settle_memory()))
        # a SIGTERM that systemd did not send may be a container host taking the machine: sync first
        if self._stop_signal == signal.SIGTERM and self.spot.on_sigterm():
            self.spot.wait_outcome(self._stop_again)
        self.shutdown()

    def shutdown(self) -> None:
        """Leave the training running: a daemon stop or upgrade must never end someone's run."""
        notify("STOPPING=1")
        log.info("daemon_stopping", training=self.training.state.value)
        try:
            self.scheduler.shutdown(wait=False)
        except Exception:  # noqa: BLE001
            pass
        self.control.close()
        for spec in reversed(self.built):  # a wing closes before the wings it was built from
            if spec.close and (w := getattr(self, spec.name)) is not None:
                spec.close(w)
        self.ctx.alerts.tick()  # the core's, last: what closing the wings raised still goes out

    # --- status -------------------------------------------------------------------------------
    def _status_line(self) -> str:
        i = self.training.info()
        idle = self.guard.status().get("idle", {})
        return f"training {i.state.value}, idle {idle.get('state', '?')}"

    def status(self) -> dict:
        now = self.clock.time()
        tr = self.training.status()
        tr["progress"] = self.progress.snapshot(now)
        blocks: list[Block] = [DaemonBlock.of({
            "version": __version__,
            "now": now,
            "daemon": {"pid": os.getpid(), "started_at": self.started_at, "uptime_s": now - self.started_at,
                       "config": self.cfg.source, "state_dir": self.cfg.state_dir,
                       "problems": [*self.store.problems, *self.alerts.problems, *self.store.unsaved.values(),
                                    *filter(None, [self.reserve.problem()]), *self.channel_problems,
                                    *([self.metrics.error] if self.metrics.error else [])]},
        }), TrainingBlock.of(tr), ClusterBlock.of(None)]  # one machine: null (the cluster wing's block follows)
        for w in self.wings():
            if isinstance(w, HasStatus):
                blocks.extend(w.status_blocks())
        out: dict = {}
        for b in blocks:  # the SPEC's JSON: each block writes its own keys (supervisor/status/)
            out.update(b.to_json())
        return out

    # --- control handlers ----------------------------------------------------------------------
    def _handlers(self) -> dict[str, Verb]:
        """The daemon's own commands (the training's start and stop cross wings: the resume gate, the
        GPU preflight), then every wing's."""
        own: dict[str, Verb] = {
            "ping": lambda a: {"pong": True, "version": __version__},
            "status": lambda a: self.status(),
            "start": lambda a: self._guarded(lambda: self.resume.gate(self.training.start)),
            "stop": lambda a: self._guarded(self.training.stop, starts=False),
            "restart": lambda a: self._guarded(self.training.restart),
            "run": self._h_run,
        }
        for w in self.wings():
            if isinstance(w, HasVerbs):
                own.update(w.verbs())
        return own

    @staticmethod
    def _guarded(fn: Callable[[], Any], starts: bool = True) -> Any:
        try:
            return fn()
        except TrainingError as e:
            raise RequestError(str(e)) from None
        except OSError as e:
            if not starts:
                raise  # "nothing was started" is only the starts' to say; a stop's OSError is a bug
            # a full disk is the owner's to fix, not a bug: say which file and why (the run's spec is
            # written before tmux is asked for anything, so nothing was started)
            why = str(e) if isinstance(e, StateWriteError) else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            raise RequestError(f"{why}; nothing was started") from None

    def _h_run(self, a: dict, peer: Peer | None = None) -> Any:
        argv = a.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(x, str) for x in argv):
            raise RequestError('"run" needs "argv": a non-empty list of strings')
        if sum(len(x) for x in argv) > 16384:
            raise RequestError("command longer than 16 KiB")
        cwd, env = run_context(a)
        if (cwd is not None or env is not None) and (peer is None or peer.uid not in (0, os.geteuid())):
            # refusal() let this caller through only as root or the daemon's own user; say so again
            # here, where a process would start in a folder and environment the caller chose
            raise RequestError("run: only root (or the daemon's own user) may start a process")
        self.sync.probe_soon()  # a missing or refused key is told before this run's first checkpoint
        before = self.training.status().get("run_id")
        res = self._guarded(lambda: self.resume.gate(
            lambda: self.training.start(command=command_line(argv), adhoc=True, cwd=cwd, env=env)))
        if isinstance(res, dict) and res.get("resuming"):
            res["after_run_id"] = before  # `run` follows the restore to the run that comes after this one
        return res

    _h_run.wants_peer = True  # type: ignore[attr-defined]




def _run_until(stop: threading.Event, start: Callable[[], object]) -> None:
    """start(), then wait for a signal handler to set `stop`.

    The kernel hands a process's signal to any thread; Python runs the handler in the main thread
    only when that thread runs bytecode. A main thread blocked in Event.wait() is not woken by a
    signal another thread took, and then never stops (a fresh machine's SIGINT sat 90 s). The
    wakeup fd is written by the C handler on whichever thread took the signal, so this select
    always wakes: still no polling at rest."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    try:
        start()
        while not stop.is_set():
            select.select([wake_r], [], [])
            _drain(wake_r)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        os.close(wake_r)
        os.close(wake_w)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _soon():
    import datetime as dt

    return dt.datetime.now() + dt.timedelta(seconds=0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train-supervisord", description="train-supervisor daemon (foreground)")
    ap.add_argument("--config", help="config file (default $TRAIN_SUPERVISOR_CONFIG or "
                                     "/etc/train-supervisor/config.toml)")
    ap.add_argument("--version", action="version", version=__version__)
    ap.add_argument("--check-config", action="store_true",
                    help="exit 0 when the daemon would start with this config, else 2 naming each problem "
                         "(train-supervisor-start --restart asks first, and keeps the running daemon if not)")
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config)
        if nothing_watched(cfg):
            raise ConfigError(nothing_watched(cfg))
    except ConfigError as e:
        sys.stderr.write("train-supervisord: refusing to start, the config has problems:\n")
        for p in e.problems:
            sys.stderr.write(f"  {p}\n")
        return 2
    if args.check_config:
        sys.stdout.write(f"train-supervisord: the config is good: {cfg.source}\n")
        return 0
    configure(cfg.log_level)
    few_arenas()
    try:
        d = Daemon(cfg)
    except Exception as e:  # noqa: BLE001 - report clearly instead of a traceback in the journal
        log.exception("daemon_init_failed", error=str(e))
        return 1
    try:
        d.run_forever()
    except RuntimeError as e:
        log.error("daemon_failed", error=str(e))
        return 1
    _exit_now()
    return 0


def _exit_now() -> None:
    """Exit once shutdown() is done, without the interpreter's own wait: concurrent.futures joins
    every executor thread at exit (the scheduler's duties, the S3 pools), so a duty or an upload in
    flight (a process scan or an S3 part on a loaded machine, a metadata request) held the exit for
    as long as it ran, past a caller's patience and systemd's TimeoutStopSec. Everything that must
    outlive the daemon was written by shutdown(); the rest is what a kill -9 leaves, which every
    state file survives."""
    busy = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    log.info("daemon_exited", threads_not_waited_for=len(busy))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    time.tzset()
    sys.exit(main())
