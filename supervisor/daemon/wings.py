"""The list of wings: every wing of the daemon declared once, here (like SkyPilot skylet's EVENTS).

Each line names the wing, the config section it reads, how it is built, the wings it is built
from (`needs`), the wings it only calls later, once everything is built (`calls`), when its duties
run within one instant (`phase`), how it starts and closes, and the long-lived threads its start
begins and its close ends. The daemon (main.py) derives everything else from this one list:

- the build order: `needs` sorted topologically, ties kept in list order (a circle is a start-up
  error, named, and a test);
- the status order: list order (the order of the status JSON's blocks);
- the duty order: by phase, then list order;
- the start order: build order; the shutdown order: its reverse, so a wing closes before the
  wings it was built from (the disk watch before the sync engine it asks, the engine before the
  GPU monitor).

A builder sees only the wings its line `needs`; a wing it `calls` it reaches through `late`, which
looks the wing up when called, not when built (the training asks the GPU health check and the
resume gate before a start; both are built from the training). Adding a wing: write it (any of
status_blocks/duties/verbs from supervisor.interfaces, start/close where it holds threads), then
add one line here.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from supervisor.cluster.watch import ClusterWatch
from supervisor.disk.floor import DiskFloor
from supervisor.disk.watch import DiskWatch
from supervisor.fleet.metrics import MetricsDuty
from supervisor.gpu.healthwatch import HealthWatch
from supervisor.gpu.hostcheck import HostCheck
from supervisor.gpu.monitor import GpuMonitor
from supervisor.gpu.oom import OomDetector
from supervisor.gpu.wastewatch import WasteWatch
from supervisor.hooks.runner import Hooks
from supervisor.idle.guard import GuardConfig, IdleGuard
from supervisor.idle.orchestrator import OrchestratorWatch
from supervisor.money.guard import MoneyConfig, MoneyGuard
from supervisor.money.runledger import RunLedger
from supervisor.progress.stallwatch import StallWatch
from supervisor.progress.tracker import ProgressTracker
from supervisor.resume.gate import GateConfig, ResumeGate
from supervisor.spot.guard import SpotGuard
from supervisor.states import TRAINING_ALIVE
from supervisor.stop.rules import StopReason
from supervisor.stop.runner import StopRunner
from supervisor.sync.engine import engine_for
from supervisor.training import ranks
from supervisor.training.job import Training
from supervisor.training.logfollow import LogFollower
from supervisor.training.runner import run_banner


class Phase(IntEnum):
    """When a wing's duties run among the duties due at one instant."""
    SENSE = 0    # reads the world: the training, the GPUs, the log, the progress it shows
    WATCH = 1    # raises a reason to stop from what was sensed: a stall, a cap
    DECIDE = 2   # acts on the reasons this instant: idle and stop, GPU health, waste, the disk
    TELL = 3     # the alerts raised this instant go out this instant
    REPORT = 4   # outward watches: the orchestrator's word, a spot notice
    EXPORT = 5   # what others read: the metrics file, the cluster's heartbeat, the run's ledger


class WiringError(RuntimeError):
    """The list of wings does not hold together: a circle of needs, or a builder reaching a wing
    it did not name. Raised at start-up, naming the wings."""


@dataclass(frozen=True)
class Wing:
    name: str                                   # the daemon's attribute, and the wing's place in status
    section: str                                # the config section it reads ("" for none of its own)
    build: Callable[[Any], object | None]       # (a view of the house) -> the wing, or None: not on this machine
    needs: tuple[str, ...] = ()                 # wings it is built from
    calls: tuple[str, ...] = ()                 # wings it only calls once all are built (through `late`)
    phase: Phase | None = None                  # its duties' turn; None: it has none
    start: Callable[[Any, Any], object] | None = None   # (house, wing): begins its threads
    close: Callable[[Any], object] | None = None        # (wing): ends them, at shutdown
    threads: tuple[str, ...] = ()               # the long-lived threads its start begins (by name)


def _world_size(h: Any) -> Callable[[], Any]:
    # this node's ranks: what its workers were told, with sync.world_size and [cluster] standing in
    c = h.cfg
    return lambda: ranks.settle(ranks.read(h.training.pids(), single_if_unset=True), c.sync.world_size,
                                c.cluster.nodes, c.cluster.rank or 0)


def _ledger(h: Any) -> RunLedger | None:
    # the run's money across machines (nodes, resumes): a ledger on the target
    c = h.cfg
    if not h.run_target or not (c.cluster.nodes > 1 or c.budget.scope == "run"):
        return None
    return RunLedger(c.cluster, c.price_per_hour, c.currency, h.run_target, h.clock, h.hostname, h.sync.sibling_target)


def _spot(h: Any) -> SpotGuard:
    spot = SpotGuard(h.ctx, h.cfg.preemption, h.sync, h.training, h.hostname, stop=h.stops.request)
    h.stops.moment_for((StopReason.PREEMPTION,), spot.moment)  # the notice's deadline
    return spot


def _money(h: Any) -> MoneyGuard:
    money = MoneyGuard(h.ctx, MoneyConfig.of(h.cfg), h.progress, h.sync, h.training, stop=h.stops.request,
                       run=h.ledger, withdraw=h.stops.withdraw)
    h.stops.moment_for((StopReason.COST, StopReason.RUNTIME, StopReason.DEADLINE), money.moment)
    return money


def _cluster(h: Any) -> ClusterWatch | None:
    c = h.cfg
    if not (c.cluster.nodes > 1 and h.run_target):
        return None
    return ClusterWatch.of(c, h.run_target, h.training, h.alerts, h.clock, h.hostname, h.stops,
                           holds=h.sync.answers.held_parts, target_at=h.sync.sibling_target,
                           since_step=lambda: h.progress.snapshot(h.clock.time()).get("since_step_s"),
                           ranks=lambda: h.sync.walker.ranks)


def _disk(h: Any) -> DiskWatch:
    c = h.cfg
    return DiskWatch(h.ctx, c.disk, h.sync, c.save_dirs, quiet=c.sync.quiet_period, saves_in=list(c.sync.watch),
                     free_min_pct=c.alerts.disk_free_min_pct)


def _guard(h: Any) -> IdleGuard:
    return IdleGuard.of(h.ctx, GuardConfig.of(h.cfg, h.stop_plan), h.training, h.gpu, h.sync, progress=h.progress,
                        full_at_end=h.disk.full_at_end, run_total=h.ledger.words if h.ledger else None,
                        hooks=h.hooks, cap_moment=h.late.stops.moment)


def _health_start(h: Any, w: HealthWatch) -> None:
    # with a burn-in, autostart waits for it: the run must not share the GPUs with the load test
    w.boot(then=h.training.maybe_autostart if h.burn_first() else None)


# The wings, in the order of their status blocks. One line each; the daemon derives the rest.
WINGS: tuple[Wing, ...] = (
    Wing("training", "training", lambda h: Training(
        h.ctx, h.cfg.training, on_start=h.on_training_start, on_end=h.on_training_end,
        before_start=h.late.health.check_start, extra_env=h.late.resume.env, gate=h.late.resume.gate),
        calls=("health", "resume"), phase=Phase.SENSE),
    Wing("gpu", "gpu", lambda h: GpuMonitor(h.ctx, h.cfg.gpu, training=h.training, keep_window_s=h.cfg.idle.gpu_window),
         needs=("training",), phase=Phase.SENSE, close=lambda w: w.close()),
    Wing("oom", "training", lambda h: OomDetector(h.ctx, log_path=h.cfg.training.log or None)),
    # resumes where the last daemon got to (an OOM printed while none ran is still seen)
    Wing("follower", "training", lambda h: LogFollower(
        h.training.log_path(), [h.oom, h.progress], start_at_end=True, store=h.store, user=h.cfg.training.user or None,
        since=run_banner(h.training.info().run_id), clock=h.clock.time),
        needs=("training", "oom", "progress"), phase=Phase.SENSE),
    Wing("progress", "progress", lambda h: ProgressTracker(
        h.ctx, h.cfg.progress, price_per_hour=h.cfg.price_per_hour, currency=h.cfg.currency, gpu=h.gpu,
        job_env=h.cfg.training.env, job_user=h.cfg.training.user, save_dirs=h.cfg.save_dirs),
        needs=("gpu",), phase=Phase.SENSE),
    Wing("sync", "sync", lambda h: engine_for(h.cfg, h.clock, h.alerts, world_size=_world_size(h),
                                              step_at=h.late.progress.step_at),
         needs=("training",), calls=("progress",), start=lambda h, w: w.start(), close=lambda w: w.close(),
         threads=("sync-worker",)),
    Wing("guard", "idle", _guard, needs=("training", "gpu", "sync", "progress", "disk", "ledger", "hooks"),
         calls=("stops",), phase=Phase.DECIDE),
    # built with the core (every wing's Context carries them); closed by the house after every wing
    Wing("alerts", "alerts", lambda h: h.ctx.alerts, phase=Phase.TELL),
    Wing("metrics", "metrics", lambda h: MetricsDuty(
        h.cfg.metrics.textfile, h.cfg.metrics.listen, h.status, h.clock.time,
        every=h.cfg.gpu.poll_interval if h.metrics_wanted(h.cfg) else None),
        phase=Phase.EXPORT, start=lambda h, w: w.start() if w.every else None, close=lambda w: w.close(),
        threads=("metrics-http",)),
    Wing("orchestrator", "training", lambda h: OrchestratorWatch(h.cfg.training.env), phase=Phase.REPORT),
    Wing("spot", "preemption", _spot, needs=("sync", "training", "stops"), phase=Phase.REPORT,
         start=lambda h, w: w.boot(), close=lambda w: w.close(), threads=("preemption-follow",)),
    # GPU health: preflight at start and before every training start (the training's before_start), faults live
    Wing("health", "health", lambda h: HealthWatch(
        h.ctx, h.cfg.health, h.cfg.training, h.gpu.probe, h.training, rate=h.run_rate,
        stop_machine=h.stops.request, gpu_every=h.cfg.gpu.poll_interval),
        needs=("gpu", "training", "stops"), calls=("progress",), phase=Phase.DECIDE, start=_health_start),
    Wing("waste", "gpu", lambda h: WasteWatch(
        h.cfg.gpu, h.gpu, h.training, h.alerts, h.clock, stop=h.stops.request, withdraw=h.stops.withdraw,
        stop_after=h.cfg.idle.stop_after_warning),
        needs=("gpu", "training", "stops"), phase=Phase.DECIDE),
    Wing("stall", "progress", lambda h: StallWatch(h.ctx, h.cfg.progress, h.training, h.gpu, h.progress),
         needs=("training", "gpu", "progress"), phase=Phase.WATCH),
    Wing("money", "budget", _money, needs=("progress", "sync", "training", "ledger", "stops"), phase=Phase.WATCH),
    Wing("hooks", "hooks", lambda h: Hooks(
        h.cfg.hooks, alert=lambda k, s, b: h.alerts.event(k, "hook_failed", "warning", s, b), facts=h.hook_facts),
        calls=("sync",)),
    Wing("disk", "disk", _disk, needs=("sync",), phase=Phase.DECIDE, start=lambda h, w: w.start(),
         close=lambda w: w.close(), threads=("disk-events",)),
    # the filesystems the disk wing forecasts get their "almost full" alert from it, not twice
    Wing("floor", "alerts", lambda h: DiskFloor(h.ctx, h.cfg.alerts, [h.cfg.state_dir, *h.cfg.save_dirs],
                                                covered=h.disk.covers),
         needs=("disk",), phase=Phase.DECIDE),
    Wing("hostcheck", "alerts", lambda h: HostCheck(h.ctx, h.cfg.alerts), phase=Phase.DECIDE),
    Wing("resume", "resume", lambda h: ResumeGate(
        GateConfig.of(h.cfg), h.clock, h.alerts, h.sync, h.hostname, run_target=h.run_target,
        busy=lambda: h.training.state in TRAINING_ALIVE),
        needs=("sync", "training"), close=lambda w: w.close()),
    Wing("cluster", "cluster", _cluster, needs=("training", "stops", "sync", "progress"), phase=Phase.EXPORT,
         close=lambda w: w.close()),
    Wing("ledger", "cluster", _ledger, needs=("sync",), phase=Phase.EXPORT, close=lambda w: w.close()),
    # every reason to stop goes through this one door (supervisor.stop), and leaves through it
    Wing("stops", "stop", lambda h: StopRunner(h.guard.request_stop, h.guard.withdraw_stop), needs=("guard",)),
)


def build_order(wings: Sequence[Wing]) -> list[Wing]:
    """`needs` sorted topologically, ties in list order; a circle or an unknown name is a WiringError."""
    by_name = {w.name: w for w in wings}
    if len(by_name) != len(wings):
        raise WiringError("a wing is declared twice: " + ", ".join(sorted({w.name for w in wings
                                                                          if [x.name for x in wings].count(w.name) > 1})))
    for w in wings:
        unknown = [n for n in (*w.needs, *w.calls) if n not in by_name]
        if unknown:
            raise WiringError(f"wing {w.name} names {', '.join(unknown)}, which no line declares")
    done: list[Wing] = []
    placed: set[str] = set()
    while len(done) < len(wings):
        ready = [w for w in wings if w.name not in placed and all(n in placed for n in w.needs)]
        if not ready:
            left = [w for w in wings if w.name not in placed]
            raise WiringError("the wings' needs go round in a circle: " + _circle(left, by_name))
        done.append(ready[0])
        placed.add(ready[0].name)
    return done


def _circle(left: list[Wing], by_name: dict[str, Wing]) -> str:
    names = {w.name for w in left}
    path = [left[0].name]
    while True:
        nxt = next(n for n in by_name[path[-1]].needs if n in names)
        if nxt in path:
            return " -> ".join([*path[path.index(nxt):], nxt])
        path.append(nxt)


def duty_order(wings: Sequence[Wing]) -> list[Wing]:
    """The wings with duties, by phase, then list order."""
    return sorted((w for w in wings if w.phase is not None), key=lambda w: (w.phase, wings.index(w)))


class Late:
    """`late.<wing>.<method>`: a callable that finds the wing when called, not when built."""

    def __init__(self, house: Any, allowed: tuple[str, ...], who: str):
        self._house, self._allowed, self._who = house, allowed, who

    def __getattr__(self, wing: str) -> Any:
        if wing not in self._allowed:
            raise WiringError(f"wing {self._who} calls {wing} without naming it in its calls")
        house = self._house

        class _Method:
            def __getattr__(self, method: str) -> Callable[..., Any]:
                return lambda *a, **kw: getattr(getattr(house, wing), method)(*a, **kw)

        return _Method()


# Built by the house before any wing (every wing's Context carries them), so every builder may read them.
CORE = ("alerts",)


class View:
    """What a builder sees: the house's own parts, the wings its line needs, and `late`."""

    def __init__(self, house: Any, wing: Wing, names: frozenset[str]):
        self._house, self._wing, self._names = house, wing, names
        self.late = Late(house, wing.calls, wing.name)

    def __getattr__(self, name: str) -> Any:
        if name in self._names and name not in (*self._wing.needs, self._wing.name, *CORE):
            raise WiringError(f"wing {self._wing.name} is built from {name} but its line does not need it")
        return getattr(self._house, name)


def build(house: Any, wings: Sequence[Wing] = WINGS) -> list[Wing]:
    """Build every wing in build order onto the house (as attributes named for them); returns that order."""
    order = build_order(wings)
    names = frozenset(w.name for w in wings)
    for w in order:
        setattr(house, w.name, w.build(View(house, w, names)))
    return order


def default_hostname(configured: str) -> str:
    return configured or socket.gethostname()
