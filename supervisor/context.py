"""What every subsystem is handed: config, clock, persisted state, alerts. No globals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.clock import Clock
from supervisor.config import Config
from supervisor.statefile import StateStore

if TYPE_CHECKING:  # the notify wing sits above the core: a type only, never an import at run time
    from supervisor.notify.alerts import Alerts


@dataclass
class Context:
    config: Config
    clock: Clock
    store: StateStore
    alerts: Alerts
