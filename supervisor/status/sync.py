"""The `sync` block (sync/status.py Board.snapshot, with the engine's target facts, probe and units)."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.durations import format_bytes, format_duration
from supervisor.states import SyncState
from supervisor.status import Block, Metric, Record, View, counter, enum, gauge
from supervisor.status.words import behind_line, unselected_line

SYNC_STATES = [s.value for s in SyncState]


@dataclass
class Waiting(Record):
    unit: str | None = None
    reason: str | None = None
    format: str | None = None
    waiting_for: str | None = None


@dataclass
class Behind(Record):
    """A file saved faster than it uploads (sync/targethealth.py Behind)."""

    unit: str | None = None
    path: str | None = None
    saves: int | None = None
    since: float | None = None
    note: str | None = None


@dataclass
class UnitFormat(Record):
    unit: str | None = None
    format: str | None = None
    complete: bool | None = None
    waiting_for: str | None = None


@dataclass
class TargetInfo(Record):
    """What a target says of itself (a Hub repo: which upload path and why, private or public, the branch)."""

    kind: str | None = None
    repo: str | None = None
    repo_type: str | None = None
    revision: str | None = None
    private: bool | None = None
    created: bool | None = None
    upload_path: str | None = None
    upload_path_reason: str | None = None
    warning: str | None = None
    endpoint: str | None = None
    folder: str | None = None
    token_from: str | None = None

    def lines(self) -> list[str]:
        """Nothing for targets other than the Hub; the warning when an existing repo is public."""
        if self.kind != "hf":
            return []
        path = {"xet": "Xet", "lfs": "LFS"}.get(self.upload_path or "", self.upload_path or "?")
        why = f" ({self.upload_path_reason})" if self.upload_path_reason else ""
        vis = {True: "private", False: "PUBLIC"}.get(self.private, "not checked yet")  # type: ignore[arg-type]
        out = [f"          via {path}{why}  {self.repo_type or 'model'} repo {vis}, branch {self.revision or 'main'}"]
        if self.warning:
            out.append(f"          WARNING: {self.warning}")
        return out


@dataclass
class SyncBlock(Block):
    KEY = "sync"
    target: str | None = None
    state: str | None = None
    last_ok_at: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    pending_bytes: int | None = None
    pending_files: int | None = None
    uploaded_files: int | None = None
    uploaded_bytes: int | None = None
    current_file: str | None = None
    rate_bps: float | None = None
    failing_for_s: float | None = None
    next_retry_in_s: float | None = None
    waiting: list[Waiting] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    target_behind: list[Behind] = field(default_factory=list)
    sent_bytes: int | None = None
    watch: list[str] = field(default_factory=list)
    unselected: list[str] = field(default_factory=list)
    unselected_files: int | None = None
    unselected_bytes: int | None = None
    unselected_items: int | None = None
    unselected_newer: bool | None = None
    target_info: TargetInfo = field(default_factory=TargetInfo)
    probe: object = None         # the target's last probe {ok, at, error}
    credentials: object = None   # where the target's keys came from {sources, problem}
    lost: list[object] = field(default_factory=list)
    units: list[UnitFormat] = field(default_factory=list)

    def lines(self, view: View) -> list[str]:
        """Target and state, what is pending and uploaded, units still waiting, partial ones, and the
        error (FAILING while the target fails)."""
        if not self.filled:
            return []
        if self.state == "disabled":
            return ["sync      disabled (no sync.target configured)"]
        now = view.now
        head = f"sync      {self.target if self.target is not None else ''}  {self.state or '?'}"
        if self.current_file and self.state == "uploading":
            head += f"  {self.current_file}"
            if self.rate_bps:
                head += f" at {format_bytes(self.rate_bps)}/s"
        out = [head]
        ok = f"{format_duration(now - self.last_ok_at)} ago" if self.last_ok_at else "never"
        out.append(f"          pending {_n(self.pending_files)} files ({format_bytes(_n(self.pending_bytes))})  "
                   f"uploaded {_n(self.uploaded_files)} files ({format_bytes(_n(self.uploaded_bytes))})  last ok {ok}")
        out += self.target_info.lines()
        out += [f"          waiting {w.unit}: {w.reason}" for w in self.waiting[:3]]
        out += [f"          partial {p}" for p in self.partial[:3]]
        for b in self.target_behind[:3]:
            since = f"behind for {format_duration(now - b.since)}; " if b.since else ""
            what = b.path or (b.unit if b.unit is not None else "?")
            out.append(f"          {behind_line(what, _n(b.saves))} "
                       f"({since}{b.note or 'save less often, or give the upload more bandwidth'})")
        names = self.unselected
        if names:  # training output no include selects: it stays here (one wording with sync --wait and the mails)
            files = self.unselected_files if self.unselected_files is not None else len(names)
            line = unselected_line(files, self.unselected_bytes or 0, names, self.unselected_items or len(names))
            out.append(f"          {line}" + ("; newer than anything on the target: a stop waits for it"
                                              if self.unselected_newer else ""))
        err = self.last_error
        if err and self.state == "failing":
            retry = self.next_retry_in_s
            retry_text = f", retry in {format_duration(retry)}" if retry is not None else ""
            out.append(f"          FAILING for {format_duration(self.failing_for_s)}{retry_text}: {err}")
        elif err:
            out.append(f"          last error: {err}")
        return out

    def metrics(self, view: View) -> list[Metric]:
        return [*enum("sync_state", "Checkpoint sync state: 1 for the current one.", self.state, SYNC_STATES),
                gauge("sync_pending_files", "Files waiting to be copied off the machine.", self.pending_files),
                gauge("sync_pending_bytes", "Bytes waiting to be copied off the machine.", self.pending_bytes),
                gauge("sync_last_success_timestamp_seconds", "When the target last held everything.", self.last_ok_at),
                counter("sync_uploaded_files_total", "Files uploaded.", self.uploaded_files),
                counter("sync_uploaded_bytes_total", "Bytes uploaded.", self.uploaded_bytes)]


def _n(x: int | None) -> int:
    return 0 if x is None else x
