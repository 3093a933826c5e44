"""What the stop driver reads of its owners, as the types the idle wing hands in: a moment (`At`), the shared
record (`Shared`) and the config's view (`Settings`). Their own module: the driver and its announcer both
name them, and the announcer is the driver's part (a type-only import back into driver.py was a circle)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from supervisor.clock import Clock
from supervisor.config import StopConfig


class At(Protocol):
    """A moment as the guard hands it in (idle.machine.Now)."""

    wall: float
    mono: float
    boot_id: str


class Shared(Protocol):
    """The record of the two machines, under one lock (idle.shared.GuardState)."""

    lock: threading.RLock
    m: Any        # idle.machine.IdleMachine: its stop fields are stop.machine's
    clock: Clock

    def save(self) -> None: ...

    def now(self) -> At: ...


class Settings(Protocol):
    """What the stop reads of the config (idle.facts.GuardConfig)."""

    stop: StopConfig
    stop_plan: Any
    final_paths: tuple[str, ...]
    sync_target: str
    price_per_hour: float | None
    currency: str
    max_idle_cost: float | None
    stop_grace: float

    @property
    def interrupt_patience(self) -> float: ...

    def patience(self, grace: float) -> float: ...
