"""The waste duty: which processes hold GPU memory for nothing (waste.py decides), an alert for each
naming the PID, its user and command when this machine can see them, the GPU and the memory, with
the command that frees it; with `gpu.on_waste = "stop"` a `waste` stop (saving first, through the one
stop door) while no training runs here: asked with the alert, which is its warning (the rule table
gives it `idle.stop_after_warning` of quiet before it begins), and withdrawn when the waste is gone or
a training runs again.

It reads the monitor's last snapshot (never NVML itself) and /proc through psutil, for PIDs in our
own PID namespace only: inside a container NVML's host PIDs may name an unrelated process here. The
host's namespace is told by its fixed inode, or proven when NVML lists one of our training's PIDs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import structlog

from supervisor.durations import format_bytes, format_duration
from supervisor.gpu import waste as w
from supervisor.interfaces import Duty
from supervisor.states import TRAINING_ALIVE
from supervisor.status import Block
from supervisor.status.gpu import WasteBlock

if TYPE_CHECKING:
    from supervisor.clock import Clock
    from supervisor.config import GpuConfig
    from supervisor.gpu.monitor import GpuMonitor
    from supervisor.interfaces import TrainingView
    from supervisor.notify.alerts import Alerts

log = structlog.get_logger("gpu")

INIT_PID_NS = 0xEFFFFFFC  # the kernel's fixed inode of the initial (host) PID namespace


def host_pid_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INIT_PID_NS
    except OSError:
        return False


class WasteWatch:
    def __init__(self, cfg: GpuConfig, monitor: GpuMonitor, training: TrainingView, alerts: Alerts, clock: Clock,
                 *, stop: Callable[[str, str], bool] | None = None, withdraw: Callable[[str], None] | None = None,
                 stop_after: float = 3600.0, host_pids: bool | None = None):
        self.cfg = cfg
        self.monitor = monitor
        self.training = training
        self.alerts = alerts
        self.clock = clock
        self._stop = stop
        self._withdraw = withdraw
        self._standing = False  # a waste stop was asked and not withdrawn
        self.stop_after = stop_after  # the notice the door gives a waste stop (for the alert's words)
        self.host_pids = host_pid_namespace() if host_pids is None else host_pids
        self._lock = threading.Lock()
        self._since: dict[str, tuple[str, float]] = {}
        self._now: list[w.Waste] = []
        self._asked: set[str] = set()

    def poll(self) -> None:
        st = self.monitor.status()
        now = self.clock.monotonic()
        alive = self.training.info().state in TRAINING_ALIVE
        gpus = st.get("gpus") or []
        # NVML's PIDs are ours once one of them is our training's (a container run with the host's
        # PID namespace, or a driver that translates): from then on they are looked up here
        self.host_pids = self.host_pids or any(p.get("training") for g in gpus for p in g.get("processes") or [])
        holders, util = [], {}
        for g in gpus:
            util[g["index"]] = g.get("util_pct")
            for p in g.get("processes") or []:
                holders.append(self._holder(g["index"], p))
        with self._lock:
            self._since = w.observe(self._since, holders, util, self.host_pids, alive, now)
            found = w.judge(self._since, holders, now, self.cfg.waste_after)
            gone = {x.key for x in self._now} - {x.key for x in found}
            self._now = found
            self._asked &= {x.key for x in found}
        for key in gone:
            self.alerts.resolve(f"gpu:waste:{key}")
        for x in found:
            self._alert(x)
        if self.cfg.on_waste == "stop" and self._stop is not None:
            held = [] if alive else [x for x in found if x.actionable]
            new = [x for x in held if x.key not in self._asked]
            if new:  # the alert is the warning: the door waits its notice (stop.rules) before the stop
                self._asked.update(x.key for x in new)
                self._standing = True
                self._stop("waste", "; ".join(self._words(x) for x in held[:3]))
            elif self._standing and not held:  # freed, or a training runs here again: no cause left
                self._standing = False
                self._asked.clear()
                if self._withdraw is not None:
                    self._withdraw("waste")

    def _holder(self, gpu: int, p: dict) -> w.Holder:
        pid, user, command, exists = int(p.get("pid") or 0), "", "", False
        if self.host_pids and pid > 0:
            try:
                proc = psutil.Process(pid)
                exists = proc.status() != psutil.STATUS_ZOMBIE
                user = proc.username()
                command = " ".join(proc.cmdline())[:200] or proc.name()
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                exists = False
            except (psutil.AccessDenied, OSError):
                exists = True
        return w.Holder(gpu, pid, p.get("mem_bytes"), bool(p.get("training")), exists, user, command)

    def _words(self, x: w.Waste) -> str:
        who = f"PID {x.pid}"
        if x.kind == w.IDLE and (x.user or x.command):
            who += f" ({x.user}: {x.command})" if x.user else f" ({x.command})"
        how = {w.IDLE: "at 0 % utilization", w.DEAD: "by a process that no longer exists",
               w.NOT_VISIBLE: "by a PID not visible in this container"}[x.kind]
        return f"GPU {x.gpu}: {format_bytes(x.mem_bytes)} held by {who} {how} for {format_duration(x.for_s)}"

    def _alert(self, x: w.Waste) -> None:
        then = ""
        if self.cfg.on_waste == "stop" and x.actionable:
            then = (f"gpu.on_waste = \"stop\": once this has stood {format_duration(self.stop_after)} more and no "
                    "training runs here, the machine is stopped (final verified sync first).\n")
        body = (f"{self._words(x)}.\nIt does no work and the machine bills for it. This memory never counts as "
                f"activity: the idle rule goes on as if it were free.\nTo free it: {w.free_with(x)}\n{then}")
        self.alerts.fire(f"gpu:waste:{x.key}", "gpu_waste", "warning", self._words(x), body)

    def status(self) -> list[dict]:
        with self._lock:
            found = list(self._now)
        return [{"gpu": x.gpu, "pid": x.pid, "mem_bytes": x.mem_bytes, "kind": x.kind, "for_s": round(x.for_s),
                 "user": x.user, "command": x.command, "free_with": w.free_with(x)} for x in found]

    def duties(self) -> tuple[Duty, ...]:
        return (Duty("waste", max(5.0, self.cfg.poll_interval), self.poll),)  # GPU memory held for nothing

    def status_blocks(self) -> tuple[Block, ...]:
        return (WasteBlock.of({"gpu_waste": self.status()}),)
