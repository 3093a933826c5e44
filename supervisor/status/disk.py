"""The `disk` block (disk/watch.py): a forecast per filesystem, and the deletes of checkpoints verified
off the machine."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.durations import format_bytes
from supervisor.status import Block, Metric, Record, View, counter, gauge
from supervisor.timefmt import clock


@dataclass
class Filesystem(Record):
    mount: str | None = None
    paths: list[str] = field(default_factory=list)
    free_bytes: int | None = None
    total_bytes: int | None = None
    free_pct: float | None = None
    full_in_s: float | None = None
    alert_before_s: float | None = None
    checkpoint_bytes: int | None = None
    interval_s: float | None = None
    need_bytes: int | None = None
    saves_left: int | None = None
    reclaimable_bytes: int | None = None
    prune_keeps_up: bool | None = None
    checkpoints: int | None = None
    checkpoints_bytes: int | None = None
    verified_off: int | None = None
    reasons: list[str] = field(default_factory=list)
    alert: bool | None = None
    line: str | None = None


@dataclass
class DiskEvent(Record):
    at: float | None = None
    event: str | None = None
    path: str | None = None
    bytes: int | None = None
    target: str | None = None
    verified_at: float | None = None
    error: str | None = None
    unit: str | None = None
    replace: bool | None = None


@dataclass
class DiskBlock(Block):
    KEY = "disk"
    prune: str | None = None
    keep_local: int | None = None
    alert_before_s: float | None = None
    filesystems: list[Filesystem] = field(default_factory=list)
    deleted: int | None = None
    freed_bytes: int | None = None
    recent: list[DiskEvent] = field(default_factory=list)
    last_prune: object = None

    def lines(self, view: View) -> list[str]:
        """One forecast line per filesystem, then the last deletes (docs/disk.md)."""
        out = [f"disk      {fs.line or ''}" for fs in self.filesystems]
        if out and self.prune == "synced":
            out.append(f"          prune synced, keep_local {self.keep_local}: {self.deleted or 0} deleted "
                       f"({format_bytes(self.freed_bytes or 0)})")
        for e in [e for e in self.recent if e.event in ("deleted", "delete_failed")][-3:]:
            what = "deleted" if e.event == "deleted" else f"delete FAILED ({e.error or ''})"
            out.append(f"          {what} {e.path} ({format_bytes(e.bytes or 0)}, verified on "
                       f"{e.target or 'the target'} {clock(e.verified_at, view.now)})")
        return out

    def metrics(self, view: View) -> list[Metric]:
        out = []
        for fs in self.filesystems:
            lab = {"mount": fs.mount or ""}
            out += [gauge("disk_free_bytes", "Free bytes on a training filesystem.", fs.free_bytes, lab),
                    gauge("disk_size_bytes", "Size of a training filesystem.", fs.total_bytes, lab),
                    gauge("disk_full_in_seconds", "Forecast: seconds until the save that would not fit.",
                          fs.full_in_s, lab),
                    gauge("disk_checkpoint_bytes", "Size of the newest checkpoint.", fs.checkpoint_bytes, lab),
                    gauge("disk_checkpoints_local", "Complete checkpoints on this filesystem.", fs.checkpoints, lab),
                    gauge("disk_checkpoints_off_machine", "Of those, verified off the machine.", fs.verified_off, lab)]
        return [*out, counter("disk_pruned_total", "Local checkpoints deleted once verified on the target.", self.deleted),
                counter("disk_pruned_bytes_total", "Bytes those deletes freed.", self.freed_bytes)]
