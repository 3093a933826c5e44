"""What every subsystem is handed: config, clock, persisted state, alerts. No globals."""

from __future__ import annotations

from dataclasses import dataclass

from .alerts import Alerts
from .clock import Clock
from .config import Config
from .statefile import StateStore


@dataclass
class Context:
    config: Config
    clock: Clock
    store: StateStore
    alerts: Alerts
