"""The state machines' states and the legal moves between them, and the one table of stop rules.
No imports beyond enum and dataclasses, on purpose: this file is the one place to read what states
exist and how each reason to stop behaves."""

from __future__ import annotations

from dataclasses import dataclass
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
    IdleState.WARNED: frozenset({IdleState.ACTIVE, IdleState.STOPPING}),
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


# --- why a machine stops: the one rule table ----------------------------------------------------------
class StopReason(StrEnum):
    """The reasons `status --json` stop.reason names (SPEC, fourth round)."""

    IDLE = "idle"
    FINISHED = "finished"
    FAILED = "failed"
    COST = "cost"
    RUNTIME = "runtime"
    DEADLINE = "deadline"
    HEALTH = "health"
    NODE_LOST = "node_lost"
    PREEMPTION = "preemption"
    STALLED = "stalled"
    WASTE = "waste"
    MANUAL = "manual"


@dataclass(frozen=True)
class StopRule:
    warns: str                # "warning": warn_after, the warning mail, stop_after_warning; "grace":
                              # finish_grace after the result mail; "none": the stop begins when asked
    activity_cancels: bool    # a login, a keepalive, GPU load before the action cancels it (and it is dropped)
    keepalive_moves: bool     # `keepalive` postpones it; otherwise keepalive is refused while it stands
    rank: int                 # asked while a stop of lower rank is under way, it takes that stop over
    cuts_sync_short: bool     # a hard cap: the final sync gets only the time left to its moment
    words: str                # how the stop mail names it
    hung: bool = False        # the training is presumed stuck in a collective (a lost node): each of
                              # SIGINT and SIGTERM gets HUNG_GRACE_S, not training.stop_grace


# A process stuck in an NCCL/gloo collective never runs Python's SIGINT handler; torchrun ends its
# workers on SIGTERM. The survivors of a lost node must be saved and stopped within two minutes.
HUNG_GRACE_S = 10.0


R = StopReason
STOP_RULES: dict[StopReason, StopRule] = {
    R.IDLE: StopRule("warning", True, True, 0, False, "idle"),
    R.STALLED: StopRule("warning", True, True, 0, False, "the training stalled"),
    R.WASTE: StopRule("warning", True, True, 0, False, "GPU memory held for nothing"),
    R.FINISHED: StopRule("grace", True, True, 1, False, "training finished"),
    R.FAILED: StopRule("grace", True, True, 1, False, "training failed"),
    R.NODE_LOST: StopRule("none", False, False, 2, False, "a node of the run was lost", hung=True),
    R.HEALTH: StopRule("none", False, False, 3, False, "GPU health BAD"),
    R.COST: StopRule("none", False, False, 4, True, "the spend cap"),
    R.RUNTIME: StopRule("none", False, False, 4, True, "the runtime cap"),
    R.DEADLINE: StopRule("none", False, False, 4, True, "the deadline"),
    R.PREEMPTION: StopRule("none", False, False, 5, True, "the provider is taking the machine"),
    R.MANUAL: StopRule("none", False, False, 6, False, "a stop was asked for"),
}

# The caps' kinds (supervisor.money): each a word a stop is asked with, and how budget.json names it.
CAP_KINDS = ("max_cost", "deadline", "max_runtime")

# The words the wings ask with (a cap's kind, a health verdict), kept in stop.json and idle.json:
# each is one reason of the table.
# "" is a stop record of an older daemon that named no reason: it was an idle stop.
STOP_WORDS: dict[str, StopReason] = {"max_cost": R.COST, "max_runtime": R.RUNTIME, "gpu_bad": R.HEALTH,
                                     "": R.IDLE, **{r.value: r for r in StopReason}}


def stop_reason(word: str) -> StopReason:
    """The reason a stop word stands for; an unknown word (a newer daemon's) is treated as manual:
    nothing cancels it by accident."""
    return STOP_WORDS.get(word, R.MANUAL)


def stop_rule(word: str) -> StopRule:
    return STOP_RULES[stop_reason(word)]


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
