"""The seams between subsystems, as Protocols. Each side is built and tested against these alone;
the daemon wires the real objects together. Plain data crosses them, never live objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from supervisor.errors import (
    RequestError as RequestError,  # defined without imports: supervisorctl catches it
)
from supervisor.states import TrainingState

if TYPE_CHECKING:  # the progress wing sits above the core: a type only
    from supervisor.progress.stall import View as StallView
    from supervisor.status import Block


@dataclass(frozen=True)
class TrainingInfo:
    """A snapshot of the training job (from supervisor.training.job)."""

    state: TrainingState
    pid: int | None = None            # the job's shell inside tmux (host PID)
    started_at: float | None = None   # wall time
    ended_at: float | None = None     # wall time of the exit, when ended
    exit_code: int | None = None      # 0.., or -N when killed by signal N
    signal: str | None = None         # "SIGKILL" when killed by a signal
    restarts: int = 0
    command: str = ""
    log_path: str = ""
    workdir: str = ""
    session: str = ""
    run_id: int = 0                   # increments with every start; lets listeners tell runs apart


class TrainingView(Protocol):
    def info(self) -> TrainingInfo: ...

    def pids(self) -> set[int]:
        """The job's process tree now (shell and descendants), for GPU-process and CPU attribution."""
        ...

    def stop(self) -> Any:
        """Stop the job as `supervisorctl stop` does (SIGINT, then SIGTERM and SIGKILL after the grace,
        escalated by the training's own poll); returns at once. Raises when nothing is running."""
        ...


class GpuView(Protocol):
    def utilization(self, window_s: float) -> float | None:
        """Highest per-GPU mean utilization % over the last window_s seconds; None when unknown
        (no driver, NotSupported, or fewer samples than cover half the window)."""
        ...

    def status(self) -> dict:
        """{"gpus": [...], "gpu_error": str | None} as in the status --json contract."""
        ...


class ProgressView(Protocol):
    """The progress tracker as the idle guard and its mails read it."""

    def snapshot(self, now: float) -> dict: ...

    def cost(self, now: float) -> dict: ...

    def stall(self, now: float) -> StallView: ...


@dataclass
class FinalSyncResult:
    ok: bool
    target: str
    files: int = 0          # files the target verifiably holds for the requested folders
    bytes: int = 0
    uploaded_files: int = 0  # sent during this call
    error: str = ""
    unsynced: list[str] = field(default_factory=list)  # paths that are not (yet) safe
    # on success: what went up although it is not a whole checkpoint (a final sync sends every file)
    damaged: list[str] = field(default_factory=list)        # files failing their format check (paths here)
    partial_units: list[str] = field(default_factory=list)  # folders, each with why: "checkpoint-8 (never ...)"
    unsynced_units: list[str] = field(default_factory=list)  # one line per folder: "PATH: 3 of 9 files (1.2 GB)"
    newest: list[str] = field(default_factory=list)      # the newest checkpoint of each run folder held
    unselected: list[str] = field(default_factory=list)  # training output no include selects: up to 20 names
    unselected_files: int = 0      # ... every such file counted, and their bytes
    unselected_bytes: int = 0
    unselected_hold: bool = False  # a checkpoint among them newer than every selected file: a stop waits
    finals: list[str] = field(default_factory=list)      # each run folder's final save, or that it left none


@dataclass(frozen=True)
class Holding:
    """One checkpoint or adapter folder as the sync engine last saw it (SyncEngine.holdings()): what a
    spot notice reports as made off the machine, what the disk wing may prune, what a stop names."""

    unit: str                 # its label ("out/checkpoint-40")
    path: str                 # its folder here
    complete: bool            # whole here (quiet, marker, format checks)
    on_target: bool           # the target holds it whole, manifest included
    mtime: float              # its newest file
    bytes: int = 0
    reason: str = ""          # why it is not complete here
    settling: bool = False    # about to become complete by itself (its writer just went quiet)


class SyncView(Protocol):
    def request_sync(self) -> None:
        """Scan and upload now (non-blocking)."""
        ...

    def final_sync(self, paths: list[str], timeout_s: float) -> FinalSyncResult:
        """Upload everything under `paths` that the policy selects, *regardless of the quiet period*
        (the writer is gone), verify the target holds it, and return; blocks up to timeout_s."""
        ...

    def status(self) -> dict:
        """The `sync` block of status --json."""
        ...


class LineListener(Protocol):
    def feed_line(self, line: str, now: float) -> None:
        """One line of the training log (decoded with errors='replace', without the newline;
        tqdm's carriage-return updates arrive as separate lines)."""
        ...

    def reset(self, now: float) -> None:
        """A new run started (or the log was truncated): forget per-run state."""
        ...



# --- what a wing exports for the daemon to list (as SkyPilot's skylet declares its EVENTS) ------------

Verb = Callable[[dict], Any]
"""A control-socket command: the request's arguments in, the JSON answer out (RequestError: refused)."""


@dataclass(frozen=True)
class Duty:
    """A periodic duty: its name (the scheduler's job id, `duty=` in the log), how often in seconds (from
    the wing's own config section; None or 0: not scheduled) and what it does. Each runs isolated: one
    that raises is logged and tried again at its next turn, never taking the others down."""

    name: str
    every: float | None
    run: Callable[[], object]


@runtime_checkable
class HasDuties(Protocol):
    def duties(self) -> tuple[Duty, ...]: ...


@runtime_checkable
class HasStatus(Protocol):
    def status_blocks(self) -> tuple[Block, ...]:
        """This wing's blocks of `status --json` (supervisor/status/: each block writes its SPEC keys,
        says its status lines and its metrics)."""
        ...


@runtime_checkable
class HasVerbs(Protocol):
    def verbs(self) -> dict[str, Verb]:
        """The control-socket commands this wing answers (who may ask is the daemon's MEMBER_COMMANDS)."""
        ...
