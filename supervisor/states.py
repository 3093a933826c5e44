"""The state machines' states and the legal moves between them. No imports beyond enum, on purpose:
this file is the one place to read what states exist."""

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


def check_training_move(old: TrainingState, new: TrainingState) -> None:
    if old != new and new not in TRAINING_MOVES[old]:
        raise IllegalTransition(f"training: {old.value} -> {new.value}")
