"""The reasons to stop that still stand, and what they mean for a stop under way. Pure.

A wing asks for a stop with a word and a sentence (`request`); the reason then stands until the
stop it led has run (`served`), until its own wing withdraws it (`cancel`: a cap moved by `budget`,
a node that came back, the waste gone), or, for a reason the table says activity cancels, until
activity comes (`on_activity`; a "grace" reason is held back instead, its grace starting over). It
is never dropped because another stop was cancelled: a GPU-BAD stop asked while an idle stop waited
for its final sync takes that stop over, and a login that cancels the idle stop leaves it standing.
A reason whose table row `warns` stands from its warning and leads a stop only once its notice has
run (`ready`, as the stop machine counts it). `advance` says what the machine must do about the
standing reasons: begin a stop, let a higher reason take one over, or give up a stop whose reason
no longer stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from supervisor.stop.rules import StopReason, stop_reason, stop_rule


@dataclass(frozen=True)
class Standing:
    word: str          # as the wing asked (a cap's kind "max_cost", "gpu_bad", ...): stop.json keeps it
    why: str           # the wing's sentence, for the stop mail and status
    since: float       # wall time of the first request

    @property
    def reason(self) -> StopReason:
        return stop_reason(self.word)

    def to_json(self) -> dict:
        return {"reason": self.reason.value, "word": self.word, "why": self.why, "since": self.since}

    @classmethod
    def from_json(cls, d: object) -> Standing:
        if not isinstance(d, dict) or not isinstance(d.get("word"), str):
            raise ValueError("a standing stop reason should be an object with a word")
        since = d.get("since")
        return cls(d["word"], str(d.get("why") or ""), float(since) if isinstance(since, int | float) else 0.0)


def request(held: tuple[Standing, ...], word: str, why: str, now: float) -> tuple[Standing, ...]:
    """`word` stands (again): a repeat keeps its first time and takes the newer sentence."""
    old = next((s for s in held if s.word == word), None)
    rest = tuple(s for s in held if s.word != word)
    return (*rest, Standing(word, why or (old.why if old else ""), old.since if old else now))


def cancel(held: tuple[Standing, ...], words: set[str] | frozenset[str]) -> tuple[Standing, ...]:
    """Its wing withdraws these (the cause went away)."""
    return tuple(s for s in held if s.word not in words)


def on_activity(held: tuple[Standing, ...]) -> tuple[Standing, ...]:
    """Activity came back: only the reasons the table lets activity cancel are dropped; a "grace"
    reason (a run's end) stays, its grace held back until the activity ends."""
    return tuple(s for s in held if not stop_rule(s.word).activity_cancels or stop_rule(s.word).warns == "grace")


def served(held: tuple[Standing, ...]) -> tuple[Standing, ...]:
    """The stop ran: every reason that stood was served by it."""
    return ()


def lead(held: tuple[Standing, ...] | list[Standing]) -> Standing | None:
    """The reason that leads: the highest rank, the earliest among equals."""
    if not held:
        return None
    return min(held, key=lambda s: (-stop_rule(s.word).rank, s.since))


def waiting(held: tuple[Standing, ...]) -> tuple[Standing, ...]:
    """The reasons whose stop waits for a notice first (the table's `warns`)."""
    return tuple(s for s in held if stop_rule(s.word).warns != "none")


def words(held: tuple[Standing, ...]) -> set[str]:
    return {s.word for s in held}


def takes_over(word: str, current: str) -> bool:
    """Does a stop for `word` take over a stop under way for `current` (not yet acting)?"""
    return stop_rule(word).rank > stop_rule(current).rank


@dataclass(frozen=True)
class Advance:
    begin: Standing | None = None     # begin (or take over with) a stop for this reason
    abort_current: bool = False       # the stop under way gives way to it (or, with no begin, ends:
                                      # its reason was withdrawn and nothing else is ready)


def advance(held: tuple[Standing, ...], stopping: bool, current: str, committed: bool, stopped: bool,
            ready: Callable[[Standing], bool] = lambda s: True) -> Advance:
    """What the standing reasons ask of the machine now. `stopping`: a stop is under way for
    `current`; `committed`: its action has begun (nothing takes it over or ends it: it stops the
    machine for every reason at once); `stopped`: the stop ran and the machine is still up (a dry
    run). `ready`: has a reason's notice run (the stop machine counts it; a reason that warns
    never leads a stop before)."""
    if committed or stopped:
        return Advance()
    top = lead([s for s in held if stop_rule(s.word).warns == "none" or ready(s)])
    if stopping and current not in words(held):
        return Advance(begin=top, abort_current=True)  # withdrawn: the stop it led ends (or another takes it)
    if top is None:
        return Advance()
    if not stopping:
        return Advance(begin=top)
    if top.word != current and takes_over(top.word, current):
        return Advance(begin=top, abort_current=True)
    return Advance()
