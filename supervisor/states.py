"""The state machines' states and the legal moves between them (the stop rule table beside them is
supervisor/stop/rules.py). No imports beyond enum and that table, on purpose: this file is the one
place to read what states exist."""

from __future__ import annotations

from enum import StrEnum


class TrainingState(StrEnum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


TRAINING_ALIVE = frozenset({TrainingState.STARTING, TrainingState.RUNNING, TrainingState.STOPPING})
TRAINING_ENDED = frozenset({TrainingState.STOPPED, TrainingState.FINISHED, TrainingState.FAILED})

TRAINING_MOVES: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.STOPPED: frozenset({TrainingState.STARTING}),
    TrainingState.FINISHED: frozenset({TrainingState.STARTING}),
    TrainingState.FAILED: frozenset({TrainingState.STARTING}),
    TrainingState.STARTING: frozenset({TrainingState.RUNNING, TrainingState.FAILED, TrainingState.FINISHED,
                                       TrainingState.STOPPING, TrainingState.STOPPED}),
    TrainingState.RUNNING: frozenset({TrainingState.STOPPING, TrainingState.FINISHED, TrainingState.FAILED,
                                      TrainingState.STOPPED}),
    TrainingState.STOPPING: frozenset({TrainingState.STOPPED, TrainingState.FINISHED, TrainingState.FAILED}),
}


class IdleState(StrEnum):
    ACTIVE = "ACTIVE"
    IDLE = "IDLE"
    WARNED = "WARNED"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"


class IllegalTransition(Exception):
    pass


# The idle machine's moves (supervisor.idle.machine moves only through check_idle_move). A stop may
# begin from any state (a reason that needs no warning: a cap, a bad GPU, a lost node); only
# activity, or a new run on a machine whose stop left it up, brings it back to ACTIVE.
IDLE_MOVES: dict[IdleState, frozenset[IdleState]] = {
    IdleState.ACTIVE: frozenset({IdleState.IDLE, IdleState.WARNED, IdleState.STOPPING}),   # WARNED: a finish grace
    IdleState.IDLE: frozenset({IdleState.ACTIVE, IdleState.WARNED, IdleState.STOPPING}),
    # WARNED -> IDLE: the reason the notice ran for was withdrawn by its wing (the waste went away)
    IdleState.WARNED: frozenset({IdleState.ACTIVE, IdleState.IDLE, IdleState.STOPPING}),
    IdleState.STOPPING: frozenset({IdleState.ACTIVE, IdleState.STOPPED}),
    IdleState.STOPPED: frozenset({IdleState.ACTIVE, IdleState.STOPPING}),
}


def check_idle_move(old: IdleState, new: IdleState) -> None:
    if old != new and new not in IDLE_MOVES[old]:
        raise IllegalTransition(f"idle: {old.value} -> {new.value}")


def check_training_move(old: TrainingState, new: TrainingState) -> None:
    if old != new and new not in TRAINING_MOVES[old]:
        raise IllegalTransition(f"training: {old.value} -> {new.value}")


# --- the stop sequence (stop.json) -------------------------------------------------------------------
class StopPhase(StrEnum):
    INTERRUPTING = "interrupting"  # a live training was asked to stop (SIGINT, SIGTERM, SIGKILL); waiting for its end
    FINAL_SYNC = "final_sync"   # uploading and verifying what the stop would otherwise leave behind
    ACTING = "acting"           # the stop action has been started (resumed, never repeated blindly)
    DONE = "done"
    CANCELLED = "cancelled"     # activity came back before the action ran


STOP_MOVES: dict[StopPhase, frozenset[StopPhase]] = {
    # the final sync comes only after the training has ended: what it saves on the way out goes up too
    StopPhase.INTERRUPTING: frozenset({StopPhase.FINAL_SYNC, StopPhase.CANCELLED}),
    # a training found alive (again) before the action is interrupted first
    StopPhase.FINAL_SYNC: frozenset({StopPhase.INTERRUPTING, StopPhase.ACTING, StopPhase.CANCELLED,
                                     StopPhase.DONE}),
    # a failed action goes back to FINAL_SYNC: sync again (cheap when nothing changed) before the next try
    StopPhase.ACTING: frozenset({StopPhase.DONE, StopPhase.FINAL_SYNC}),
    StopPhase.DONE: frozenset(),
    StopPhase.CANCELLED: frozenset(),
}


def check_stop_move(old: StopPhase, new: StopPhase) -> None:
    if old != new and new not in STOP_MOVES[old]:
        raise IllegalTransition(f"stop: {old.value} -> {new.value}")


# --- why a machine stops: the one rule table lives in supervisor/stop/rules.py (re-exported here for
# the imports that name it from here; rules.py, like this file, imports nothing of the product)
from supervisor.stop.rules import (  # noqa: E402
    CAP_KINDS,
    HUNG_GRACE_S,
    STOP_RULES,
    STOP_WORDS,
    StopReason,
    StopRule,
    stop_reason,
    stop_rule,
)

__all__ = ["CAP_KINDS", "HUNG_GRACE_S", "STOP_RULES", "STOP_WORDS", "StopReason", "StopRule", "stop_reason",
           "stop_rule"]


# --- the sync engine ---------------------------------------------------------------------------------
class SyncState(StrEnum):
    DISABLED = "disabled"       # no sync.target: nothing leaves this machine
    IDLE = "idle"
    SCANNING = "scanning"
    UPLOADING = "uploading"
    FAILING = "failing"         # the last attempt failed; retrying with backoff


SYNC_MOVES: dict[SyncState, frozenset[SyncState]] = {
    SyncState.DISABLED: frozenset(),
    SyncState.IDLE: frozenset({SyncState.SCANNING, SyncState.UPLOADING, SyncState.FAILING}),
    SyncState.SCANNING: frozenset({SyncState.IDLE, SyncState.UPLOADING, SyncState.FAILING}),
    SyncState.UPLOADING: frozenset({SyncState.IDLE, SyncState.SCANNING, SyncState.FAILING}),
    SyncState.FAILING: frozenset({SyncState.IDLE, SyncState.SCANNING, SyncState.UPLOADING}),
}


def check_sync_move(old: SyncState, new: SyncState) -> None:
    if old != new and new not in SYNC_MOVES[old]:
        raise IllegalTransition(f"sync: {old.value} -> {new.value}")
