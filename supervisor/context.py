"""What every wing is handed besides its own config section: clock, persisted state, alerts.

No config here: each wing receives its section (and the few facts of other sections it needs, by
name) from the daemon, so a reader sees what a wing depends on from its constructor. No globals."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.clock import Clock
from supervisor.statefile import StateStore

if TYPE_CHECKING:  # the notify wing sits above the core: a type only, never an import at run time
    from supervisor.notify.alerts import Alerts


@dataclass
class Context:
    clock: Clock
    store: StateStore
    alerts: Alerts

    @property
    def state_dir(self) -> Path:
        return self.store.dir
