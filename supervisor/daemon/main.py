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
import socket
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
from supervisor.context import Context
from supervisor.daemon.control import ControlServer, Peer, RequestError
from supervisor.daemon.malloc import few_arenas, settle_memory
from supervisor.daemon.systemd_notify import notify, watchdog_interval
from supervisor.interfaces import Duty, HasDuties, HasStatus, HasVerbs, TrainingInfo, Verb
from supervisor.logging_setup import configure
from supervisor.notify.alerts import Alerts
from supervisor.requests import run_context
from supervisor.statefile import Reserve, StateStore, StateWriteError, secure_state_dir
from supervisor.states import TRAINING_ALIVE, TrainingState
from supervisor.training.job import Training, TrainingError, command_line
from supervisor.training.runner import run_banner

log = structlog.get_logger("daemon")

# What a socket_group member (any peer but root and the daemon's own user) may ask: read and nudge.
# start/restart/run start a process as root; stop ends someone's training (and, with
# on_finish = "stop", stops the machine): those stay root's. A new command is root's until added here.
MEMBER_COMMANDS = frozenset({"ping", "status", "alerts", "keepalive", "sync", "health"})


class Daemon:
    def __init__(self, cfg: Config, clock: Clock | None = None):
        from supervisor.config.cluster import for_node

        cfg, self.run_target = for_node(cfg, os.environ)  # a node of several syncs its part
        self.cfg = cfg
        self.clock = clock or SystemClock()
        self.started_at = self.clock.time()
        from supervisor.daemon.channels import register_secrets

        register_secrets(cfg)   # masked by value in every message from now on (supervisor.redact)
        from supervisor.stop.resolve import choose, priced

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
        from supervisor.daemon.channels import build_channels
        from supervisor.fleet.metrics import MetricsDuty
        from supervisor.notify.webhook import facts_for

        hostname = cfg.hostname or socket.gethostname()
        self.metrics = MetricsDuty(cfg.metrics.textfile, cfg.metrics.listen, self.status, self.clock.time,
                                   every=cfg.gpu.poll_interval if self.metrics_wanted(cfg) else None)
        channels, self.channel_problems = build_channels(
            cfg, hostname=hostname, facts=lambda kind: facts_for(kind, self._fresh_status()))
        self.alerts = Alerts(cfg.alerts, self.clock, cfg.state_dir, hostname=hostname, channels=channels,
                             on_alert=self._on_alert)
        from supervisor.idle.orchestrator import OrchestratorWatch

        self.orchestrator = OrchestratorWatch(cfg.training.env)
        self.ctx = Context(self.clock, self.store, self.alerts)
        # the wings built later are reached through these callables, at call time (nothing patched in)
        self.training = Training(self.ctx, cfg.training, on_start=self._on_training_start, on_end=self._on_training_end,
                                 before_start=lambda: self.health.check_start(), extra_env=lambda: self.resume.env(),
                                 gate=lambda start: self.resume.gate(start))

        from supervisor.gpu.hostcheck import HostCheck
        from supervisor.gpu.monitor import GpuMonitor
        from supervisor.gpu.oom import OomDetector
        from supervisor.progress.tracker import ProgressTracker
        from supervisor.sync.engine import engine_for
        from supervisor.training import ranks
        from supervisor.training.logfollow import LogFollower

        self.gpu = GpuMonitor(self.ctx, cfg.gpu, training=self.training, keep_window_s=cfg.idle.gpu_window)
        # this node's ranks: what its workers were told, with sync.world_size and [cluster] standing in
        self.sync = engine_for(cfg, self.clock, self.alerts, world_size=lambda: ranks.settle(
                                   ranks.read(self.training.pids(), single_if_unset=True), cfg.sync.world_size,
                                   cfg.cluster.nodes, cfg.cluster.rank or 0),
                               step_at=lambda t: self.progress.step_at(t))
        self.progress = ProgressTracker(self.ctx, cfg.progress, price_per_hour=cfg.price_per_hour, currency=cfg.currency,
                                        gpu=self.gpu, job_env=cfg.training.env, job_user=cfg.training.user,
                                        save_dirs=cfg.save_dirs)
        self.oom = OomDetector(self.ctx, log_path=cfg.training.log or None)
        # resumes where the last daemon got to (an OOM printed while none ran is still seen)
        self.follower = LogFollower(self.training.log_path(), [self.oom, self.progress], start_at_end=True,
                                    store=self.store, user=cfg.training.user or None,
                                    since=run_banner(self.training.info().run_id), clock=self.clock.time)
        from supervisor.disk.floor import DiskFloor
        from supervisor.disk.watch import DiskWatch

        self.disk = DiskWatch(self.ctx, cfg.disk, self.sync, cfg.save_dirs,
                              quiet=cfg.sync.quiet_period, saves_in=list(cfg.sync.watch),
                              free_min_pct=cfg.alerts.disk_free_min_pct)
        disk_paths = [cfg.state_dir, *cfg.save_dirs]
        # the filesystems the disk wing forecasts get their "almost full" alert from it, not twice
        self.floor = DiskFloor(self.ctx, cfg.alerts, disk_paths, covered=self.disk.covers)
        self.hostcheck = HostCheck(self.ctx, cfg.alerts)

        from supervisor.idle.guard import GuardConfig, IdleGuard
        from supervisor.money.runledger import RunLedger
        from supervisor.progress.stallwatch import StallWatch

        # the run's money across machines (nodes, resumes): a ledger on the target
        self.ledger = RunLedger(cfg.cluster, cfg.price_per_hour, cfg.currency, self.run_target, self.clock, hostname,
                                self.sync.sibling_target) if self.run_target and (
            cfg.cluster.nodes > 1 or cfg.budget.scope == "run") else None
        from supervisor.hooks.runner import Hooks

        self.hooks = Hooks(cfg.hooks, alert=lambda k, s, b: self.alerts.event(k, "hook_failed", "warning", s, b),
                           facts=lambda: self._hook_facts(hostname))
        self.guard = IdleGuard.of(self.ctx, GuardConfig.of(cfg, self.stop_plan), self.training, self.gpu, self.sync,
                                  progress=self.progress, full_at_end=self.disk.full_at_end,
                                  run_total=self.ledger.words if self.ledger else None, hooks=self.hooks,
                                  cap_moment=lambda word: self.stops.moment(word))
        self.stall = StallWatch(self.ctx, cfg.progress, self.training, self.gpu, self.progress)
        from supervisor.stop.rules import StopReason
        from supervisor.stop.runner import StopRunner

        # every reason to stop goes through this one door (supervisor.stop), and leaves through it
        self.stops = StopRunner(self.guard.request_stop, self.guard.withdraw_stop)

        from supervisor.spot.guard import SpotGuard

        self.spot = SpotGuard(self.ctx, cfg.preemption, self.sync, self.training, hostname, stop=self.stops.request)
        self.stops.moment_for((StopReason.PREEMPTION,), self.spot.moment)  # the notice's deadline

        from supervisor.gpu.healthwatch import HealthWatch
        # GPU health: preflight at start and before every training start (Training's hook), faults live
        self.health = HealthWatch(self.ctx, cfg.health, cfg.training, self.gpu.probe, self.training, rate=self._run_rate,
                                  stop_machine=self.stops.request, gpu_every=cfg.gpu.poll_interval)
        from supervisor.gpu.wastewatch import WasteWatch

        self.waste = WasteWatch(cfg.gpu, self.gpu, self.training, self.alerts, self.clock, stop=self.stops.request,
                                withdraw=self.stops.withdraw, stop_after=cfg.idle.stop_after_warning)

        from supervisor.money.guard import MoneyConfig, MoneyGuard

        self.money = MoneyGuard(self.ctx, MoneyConfig.of(cfg), self.progress, self.sync, self.training, stop=self.stops.request,
                                run=self.ledger, withdraw=self.stops.withdraw)
        self.stops.moment_for((StopReason.COST, StopReason.RUNTIME, StopReason.DEADLINE), self.money.moment)

        self.cluster = None
        if cfg.cluster.nodes > 1 and self.run_target:
            from supervisor.cluster.watch import ClusterWatch

            self.cluster = ClusterWatch.of(cfg, self.run_target, self.training, self.alerts, self.clock, hostname,
                                           self.stops, holds=self.sync.answers.held_parts, target_at=self.sync.sibling_target,
                                           since_step=lambda: self.progress.snapshot(self.clock.time()).get("since_step_s"),
                                           ranks=lambda: self.sync.walker.ranks)
        from supervisor.resume.gate import GateConfig, ResumeGate

        self.resume = ResumeGate(GateConfig.of(cfg), self.clock, self.alerts, self.sync, hostname, run_target=self.run_target,
                                 busy=lambda: self.training.state in TRAINING_ALIVE)

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

    def wings(self) -> list[object]:
        """Every wing, in the order of their status blocks (and of their duties within one instant)."""
        return [w for w in (self.training, self.follower, self.gpu, self.sync, self.guard, self.alerts, self.progress,
                            self.metrics, self.orchestrator, self.spot, self.health, self.money, self.hooks,
                            self.disk, self.floor, self.hostcheck, self.stall, self.resume, self.cluster,
                            self.ledger, self.waste, self.stops) if w is not None]

    def duties(self) -> list[Duty]:
        """The wings' duties, then the daemon's own two. Duties due at one instant run in this order:
        what senses (training, GPUs, log, progress) before what judges (stall, caps, idle, health), and
        the alerts last, so an alert raised this instant goes out this instant."""
        order = (self.training, self.gpu, self.follower, self.progress, self.stall, self.money, self.guard,
                 self.health, self.waste, self.disk, self.floor, self.hostcheck, self.alerts, self.orchestrator,
                 self.spot, self.metrics, self.cluster, self.ledger)
        return [*(d for w in order if isinstance(w, HasDuties) for d in w.duties()),
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

    def _on_training_start(self, info: TrainingInfo) -> None:
        self.follower.switch(info.log_path, start_at_end=True, since=run_banner(info.run_id))
        self.oom.reset(info.started_at or self.clock.time())
        self.progress.reset(self.clock.time())
        found = self.resume.local()
        self.progress.start_run(info.run_id, info.started_at or self.clock.time(), found[1] if found else None)
        self.guard.poll_soon()

    def _on_training_end(self, info: TrainingInfo) -> None:
        # read what the job printed last (an OOM traceback) before judging how it ended
        self.follower.poll(self.clock.time())
        self.progress.end_run(info.run_id, info.ended_at or self.clock.time(), self.cfg.save_dirs)
        self.oom.check_exit(info)
        if self.cluster:
            self.cluster.beat_soon()
        self.sync.request_sync()
        self.guard.on_training_ended(info)
        self.guard.poll_soon()

    def _hook_facts(self, hostname: str) -> dict[str, object]:
        """What every hook is told besides its event's own facts: the host, the target, and the newest
        checkpoint the target holds."""
        from supervisor.spot.decide import newest_unit

        newest = newest_unit([h for h in self.sync.holdings() if h.on_target])
        return {"host": hostname, "target": getattr(self.sync, "display", "") or self.cfg.sync.target,
                "checkpoint": newest.unit if newest else ""}

    def _on_alert(self, key: str, kind: str, severity: str, subject: str) -> None:
        hooks = getattr(self, "hooks", None)
        if hooks is None:
            return  # an alert raised while the daemon is still being built: no hook is wired yet
        if kind == "preemption":
            hooks.fire("preemption", {"reason": subject, "alert_key": key})
        if not kind.startswith("hook"):
            hooks.fire("alert", {"reason": subject, "alert_key": key, "alert_kind": kind, "severity": severity})

    def _fresh_status(self, wait: float = 2.0) -> dict | None:
        from supervisor.daemon.channels import status_aside

        return status_aside(self.status, wait) or self.metrics.last_status

    def _run_rate(self) -> tuple[int | None, float | None]:
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
        self.sync.start()
        self.disk.start()
        self.spot.boot()
        # with a burn-in, autostart waits for it: the run must not share the GPUs with the load test
        burn_first = bool(self.cfg.health.burn_in and self.cfg.training.autostart)
        self.health.boot(then=self.training.maybe_autostart if burn_first else None)
        self.control.start()
        c = self.cfg
        if self.metrics.every:
            self.metrics.start()
        if schedule:
            self._first_run = _soon()
            for duty in self.duties():
                self._every(duty)
            self.scheduler.start()
        if not burn_first:
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
        self.spot.close()
        self.resume.close()
        self.metrics.close()
        self.disk.close()
        for wing in (self.cluster, self.ledger):
            if wing:
                wing.close()
        self.sync.close()
        self.gpu.close()
        self.alerts.tick()

    # --- status -------------------------------------------------------------------------------
    def _status_line(self) -> str:
        i = self.training.info()
        idle = self.guard.status().get("idle", {})
        return f"training {i.state.value}, idle {idle.get('state', '?')}"

    def status(self) -> dict:
        now = self.clock.time()
        tr = self.training.status()
        tr["progress"] = self.progress.snapshot(now)
        out: dict = {
            "version": __version__,
            "now": now,
            "daemon": {"pid": os.getpid(), "started_at": self.started_at, "uptime_s": now - self.started_at,
                       "config": self.cfg.source, "state_dir": self.cfg.state_dir,
                       "problems": [*self.store.problems, *self.alerts.problems, *self.store.unsaved.values(),
                                    *filter(None, [self.reserve.problem()]), *self.channel_problems,
                                    *([self.metrics.error] if self.metrics.error else [])]},
            "training": tr,
            "cluster": None,
        }
        for w in self.wings():
            if isinstance(w, HasStatus):
                out.update(w.status_blocks())
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
