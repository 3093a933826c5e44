"""The small blocks: `orchestrator` (idle/orchestrator.py), `hooks` (hooks/runner.py) and `metrics`
(fleet/metrics.py's own state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.status import Block, Metric, View, gauge

_NAMES = {"skypilot": "SkyPilot", "dstack": "dstack"}


@dataclass
class OrchestratorBlock(Block):
    """An outer orchestrator that can stop this machine too (SkyPilot, dstack); null when none."""

    KEY = "orchestrator"
    name: str | None = None
    evidence: str | None = None
    note: str | None = None

    def lines(self, view: View) -> list[str]:
        if not self.name:
            return []
        return [f"stoppers  two: {_NAMES.get(self.name, self.name)} can stop this machine too "
                f"({self.evidence if self.evidence is not None else ''}); "
                "see docs/fleet.md, \"Under SkyPilot or dstack\""]

    def metrics(self, view: View) -> list[Metric]:
        if not self.name:
            return []
        return [gauge("orchestrator_info", "1 when an outer orchestrator (SkyPilot, dstack) was detected.", 1,
                      {"name": self.name})]


@dataclass
class HooksBlock(Block):
    """Top-level `hooks`: the last run of each hook."""

    hooks: list[object] = field(default_factory=list)


@dataclass
class MetricsBlock(Block):
    """The metrics wing's own state: where it writes, where it listens, its last error."""

    KEY = "metrics"
    textfile: str | None = None
    listen: str | None = None
    address: str | None = None
    written_at: float | None = None
    error: str | None = None
