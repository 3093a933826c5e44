"""The `resume` block (resume/gate.py): the restore from the target before a start."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_duration
from supervisor.status import Block, Metric, Record, View, gauge


@dataclass
class Restoring(Record):
    unit: str | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    rate_bps: float | None = None
    eta_s: float | None = None
    files: int | None = None


@dataclass
class ResumeBlock(Block):
    KEY = "resume"
    enabled: bool | None = None
    state: str | None = None
    if_unreachable: str | None = None
    resume_from: str | None = None
    error: str | None = None
    note: str | None = None
    line: str | None = None
    result: object = None   # resume/restore.py Restored.to_json
    attempts: int | None = None
    wait_s: float | None = None
    next_try_at: float | None = None
    next_try_in_s: float | None = None
    progress: Restoring | None = None

    def lines(self, view: View) -> list[str]:
        """Progress, the wait while the target is unreachable, the result."""
        state = self.state
        if not self.enabled and state in (None, "idle"):
            return []
        if state == "restoring":
            p = self.progress or Restoring()
            eta = p.eta_s
            return [f"resume    restoring {p.unit or '...'}: {_mib(p.bytes_done)} of "
                    f"{_mib(p.bytes_total)} MiB at {_mib(p.rate_bps)} MiB/s"
                    f"{', ETA ' + format_duration(eta) if eta is not None else ''}"]
        if state == "waiting":
            return [f"resume    WAITING for the target (try {self.attempts}, next in "
                    f"{format_duration(self.next_try_in_s)}): {self.error}"]
        if state == "done":
            return [f"resume    {self.line or 'restored'}"]
        if state in ("fresh", "failed"):
            return [f"resume    {state}: {self.note or self.error or ''}"]
        return [f"resume    on; resume from {self.resume_from or 'nothing here yet'}"]

    def metrics(self, view: View) -> list[Metric]:
        if not self.enabled:
            return []
        out = [gauge("resume_waiting", "1 while a training start waits for the target to restore a checkpoint.",
                     self.state == "waiting")]
        if self.state == "restoring":
            p = self.progress or Restoring()
            out += [gauge("resume_restored_bytes", "Bytes of the checkpoint being restored that are here.", p.bytes_done),
                    gauge("resume_restore_total_bytes", "Bytes of the checkpoint being restored.", p.bytes_total)]
        return out


def _mib(n: float | None) -> str:
    return f"{(n or 0) / 2**20:.1f}"
