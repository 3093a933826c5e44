"""What the idle guard's parts share: the idle machine (idle.json) under one lock, and what the
last poll saw (the probes' signals, the training's state). The guard polls and writes it; the stop
driver and the announcer read and step it, each under the same lock."""

from __future__ import annotations

import threading

import structlog

from supervisor.clock import Clock
from supervisor.idle.machine import IdleMachine, Now, Signals
from supervisor.interfaces import TrainingInfo
from supervisor.statefile import StateStore

log = structlog.get_logger("idle")


class GuardState:
    def __init__(self, store: StateStore, clock: Clock):
        self.store, self.clock = store, clock
        self.lock = threading.RLock()
        self.m = self._load()
        self.signals = Signals()                   # the last poll's
        self.info: TrainingInfo | None = None      # the training as the last poll saw it

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

    def save(self) -> None:
        try:
            self.store.save("idle", self.m.to_dict())
        except OSError as e:
            log.error("idle_state_save_failed", error=str(e))

    def now(self) -> Now:
        bid, up = self.clock.boot()
        return Now(self.clock.time(), self.clock.monotonic(), bid, up)
