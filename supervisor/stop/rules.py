"""Why a machine stops: the one rule table. One row per reason, written with keywords; nothing else
in the product decides what a reason does. Pure, no imports beyond the standard library.

Each column, and who reads it:
- `warns`: how long the stop waits after it is asked. "warning": the asker's warning mail was the
  notice, and the stop comes `idle.stop_after_warning` after it (never sooner than the notice
  announced); "grace": `training.finish_grace` after the result mail, started over when activity
  ends; "none": the stop begins when asked (`notice`, read by the stop machine's `due`).
- `activity_cancels`: a login, a keepalive or GPU load before the action drops the reason and
  cancels its stop (a "grace" reason is held back instead: its grace starts over).
- `keepalive_moves`: `keepalive` postpones it; otherwise keepalive is refused while it stands.
- `rank`: asked while a stop of lower rank is under way (not yet acting), it takes that stop over;
  the stop's action is named for the highest rank (`sequence.lead`).
- `cuts_sync_short`: its wing names a moment (`StopRunner.moment`): the final sync and the stop hooks
  get only the time left to it, and at that moment the stop goes ahead whatever held it.
- `interrupt`: how a live training is ended before the final sync. "sigint": as `supervisorctl stop`
  (SIGINT, then SIGTERM and SIGKILL `training.stop_grace` apart); "hung": the same with
  `HUNG_GRACE_S` (a training stuck in a collective never runs Python's SIGINT handler); "none": its
  wing signalled the training itself and the final sync runs beside it (a spot notice: the provider
  takes the machine at the deadline, the training saves on `preemption.training_signal`).
- `withdrawn_by`: what, besides the stop running, takes the reason back (`sequence.cancel`); said by
  the keepalive refusal.
- `words`: how the stop mail and status name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


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


WARNS = ("warning", "grace", "none")
INTERRUPTS = ("sigint", "hung", "none")


@dataclass(frozen=True, kw_only=True)
class StopRule:
    warns: str
    activity_cancels: bool
    keepalive_moves: bool
    rank: int
    cuts_sync_short: bool
    words: str
    interrupt: str = "sigint"
    withdrawn_by: str = ""
    # withdrawn after it interrupted the training, the training starts again: the owner who raised the
    # cap (`budget +20`) asked for more training, not for a machine left idle with its run ended
    resumes_training: bool = False

    def __post_init__(self) -> None:
        if self.warns not in WARNS or self.interrupt not in INTERRUPTS:
            raise ValueError(f"a stop rule: warns in {WARNS}, interrupt in {INTERRUPTS}")

    @property
    def hung(self) -> bool:
        """The training is presumed stuck in a collective: each of SIGINT and SIGTERM gets HUNG_GRACE_S."""
        return self.interrupt == "hung"


# A process stuck in an NCCL/gloo collective never runs Python's SIGINT handler; torchrun ends its
# workers on SIGTERM. The survivors of a lost node must be saved and stopped within two minutes.
HUNG_GRACE_S = 10.0

R = StopReason
_PERSON = "activity (a login, GPU load) or `supervisorctl keepalive`"
_CAP = "`supervisorctl budget` (root) moving the cap"
_A_WARNING = dict(warns="warning", activity_cancels=True, keepalive_moves=True, rank=0, cuts_sync_short=False,
                  withdrawn_by=_PERSON)
_AT_ONCE = dict(warns="none", activity_cancels=False, keepalive_moves=False, cuts_sync_short=False)
_A_CAP = dict(warns="none", activity_cancels=False, keepalive_moves=False, rank=4, cuts_sync_short=True,
              withdrawn_by=_CAP, resumes_training=True)

STOP_RULES: dict[StopReason, StopRule] = {
    R.IDLE: StopRule(**_A_WARNING, words="idle"),
    R.STALLED: StopRule(**_A_WARNING, words="the training stalled"),
    R.WASTE: StopRule(**_A_WARNING, words="GPU memory held for nothing"),
    R.FINISHED: StopRule(warns="grace", activity_cancels=True, keepalive_moves=True, rank=1, cuts_sync_short=False,
                         words="training finished", withdrawn_by="a new run"),
    R.FAILED: StopRule(warns="grace", activity_cancels=True, keepalive_moves=True, rank=1, cuts_sync_short=False,
                       words="training failed", withdrawn_by="a new run"),
    R.NODE_LOST: StopRule(**_AT_ONCE, rank=2, words="a node of the run was lost", interrupt="hung",
                          withdrawn_by="the node's heartbeat heard again"),
    R.HEALTH: StopRule(**_AT_ONCE, rank=3, words="GPU health BAD"),
    R.COST: StopRule(**_A_CAP, words="the spend cap"),
    R.RUNTIME: StopRule(**_A_CAP, words="the runtime cap"),
    R.DEADLINE: StopRule(**_A_CAP, words="the deadline"),
    R.PREEMPTION: StopRule(warns="none", activity_cancels=False, keepalive_moves=False, rank=5, cuts_sync_short=True,
                           words="the provider is taking the machine", interrupt="none"),
    R.MANUAL: StopRule(**_AT_ONCE, rank=6, words="a stop was asked for"),
}

# The caps' kinds (supervisor.money): each a word a stop is asked with, and how budget.json names it.
CAP_KINDS = ("max_cost", "deadline", "max_runtime")

# The words the wings ask with (a cap's kind, a health verdict), kept in stop.json and idle.json:
# each is one reason of the table.
# "" is a stop record of an older daemon that named no reason: it was an idle stop.
STOP_WORDS: dict[str, StopReason] = {"max_cost": R.COST, "max_runtime": R.RUNTIME, "gpu_bad": R.HEALTH,
                                     "": R.IDLE, **{r.value: r for r in StopReason}}


# Where each stop setting lives (`supervisorctl check-config` prints them with their values): what asks
# for each reason and shapes its notice, then what every stop's sequence reads. No key moved for the
# stop wing; the sections stay where users have them.
SETTINGS: dict[str, tuple[str, ...]] = {
    "idle": ("idle.warn_after", "idle.stop_after_warning", "price_per_hour", "max_idle_cost"),
    "stalled": ("progress.stalled_action", "progress.stall_after", "idle.warn_after", "idle.stop_after_warning"),
    "waste": ("gpu.on_waste", "gpu.waste_after", "idle.stop_after_warning"),
    "finished failed": ("training.on_finish", "training.finish_grace"),
    "node_lost": ("cluster.on_node_lost", "cluster.silent_after"),
    "health": ("health.on_bad",),
    "cost runtime deadline": ("budget.max_cost", "budget.max_runtime", "budget.deadline", "budget.margin"),
    "preemption": ("preemption.watch", "preemption.training_signal", "preemption.sigterm_grace"),
    "manual": (),
}
SEQUENCE_SETTINGS = ("training.stop_grace", "stop.final_sync", "stop.final_sync_timeout", "stop.retry_interval",
                     "stop.stop_even_if_sync_fails", "stop.action")


def stop_reason(word: str) -> StopReason:
    """The reason a stop word stands for; an unknown word (a newer daemon's) is treated as manual:
    nothing cancels it by accident."""
    return STOP_WORDS.get(word, R.MANUAL)


def stop_rule(word: str) -> StopRule:
    return STOP_RULES[stop_reason(word)]


def notice(word: str, stop_after_warning: float, finish_grace: float, announced: float = 0.0) -> float:
    """Seconds the stop for `word` waits after it is asked (its `warns`): a warning's wait is never
    shorter than the one its mail announced, so a config change can postpone a stop, never hasten it."""
    warns = stop_rule(word).warns
    if warns == "warning":
        return max(announced, stop_after_warning)
    if warns == "grace":
        return announced if announced > 0 else finish_grace
    return 0.0


def is_cap(word: str) -> bool:
    """A reason whose moment its wing names (the money caps, a spot notice's deadline)."""
    return stop_rule(word).cuts_sync_short
