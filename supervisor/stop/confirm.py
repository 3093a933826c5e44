"""The provider stop, confirmed: one call per attempt, then the provider's own state read back until it
says the machine no longer bills. Pure: the shell (stop/carry.py) asks `next_step`, does it, and
records what came back through the moves below; the record is saved before every call.

An attempt is CALLING from the moment it is saved until the provider answers. A daemon killed in
between cannot know whether the call went out, so a CALLING attempt found on resume is never called
again: its state is read, and only when `confirm_within` passes with the machine still billing does
a new attempt (a new call) begin. A refusal (4xx) or a call that did not go out ends the attempt;
the next one waits for stop.retry_interval (the stop sequence's retry).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from enum import StrEnum

MAX_ATTEMPTS_KEPT = 10


class Phase(StrEnum):
    CALLING = "calling"              # saved, the call under way (or cut short by a restart)
    CALLED = "called"                # the provider took it (or did not answer: it may have)
    REFUSED = "refused"              # 4xx: its answer is kept
    FAILED = "failed"                # the call did not go out, or a 5xx
    STILL_BILLING = "still_billing"  # accepted, and still billing after confirm_within
    CONFIRMED = "confirmed"          # the provider reports it not billed


class Step(StrEnum):
    CALL = "call"                    # begin an attempt: save it, then make the one call
    READ = "read"                    # read the provider's state
    DONE = "done"                    # confirmed
    STILL_BILLING = "still_billing"  # confirm_within passed: say so, the next attempt calls again


OPEN = (Phase.CALLING, Phase.CALLED)


@dataclass(frozen=True)
class Attempt:
    n: int
    verb: str                   # stop | terminate
    phase: Phase
    at: float                   # wall time it was saved (just before the call)
    mono: float
    answer: str = ""            # what the provider said (scrubbed): its refusal, or what it accepted
    state: str = ""             # the last state word read
    read_at: float | None = None
    reads: int = 0
    read_error: str = ""        # why the last read failed


@dataclass(frozen=True)
class Confirm:
    provider: str = ""
    instance: str = ""
    attempts: tuple[Attempt, ...] = ()
    calls: int = 0              # provider calls made (stop or terminate), over every attempt
    confirmed: dict | None = None   # {"state": the provider's word, "at": wall time}

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["attempts"] = [{**dataclasses.asdict(a), "phase": a.phase.value} for a in self.attempts]
        return d

    @classmethod
    def from_json(cls, d: object) -> Confirm:
        """ValueError when `d` is not what to_json wrote."""
        if not isinstance(d, dict):
            raise ValueError("the provider stop record is not an object")
        try:
            atts = tuple(Attempt(**{**a, "phase": Phase(a["phase"])}) for a in d.get("attempts") or [])
            conf = d.get("confirmed")
            return cls(str(d.get("provider") or ""), str(d.get("instance") or ""), atts, int(d.get("calls") or 0),
                       conf if isinstance(conf, dict) else None)
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"the provider stop record is damaged ({e})") from None


def unknown_in_flight(provider: str, instance: str, verb: str, wall: float, mono: float) -> Confirm:
    """What a damaged record stands for: an attempt may be in flight (never call blindly again)."""
    return Confirm(provider, instance, (Attempt(0, verb, Phase.CALLING, wall, mono),), 0)


def next_step(c: Confirm, mono: float, confirm_within: float) -> Step:
    a = c.last
    if c.confirmed is not None:
        return Step.DONE
    if a is None or a.phase not in OPEN:
        return Step.CALL
    if mono - a.mono >= confirm_within:
        return Step.STILL_BILLING
    return Step.READ


def _with_last(c: Confirm, a: Attempt) -> Confirm:
    return replace(c, attempts=(*c.attempts[:-1], a))


def begin(c: Confirm, verb: str, wall: float, mono: float) -> Confirm:
    """A new attempt, CALLING: saved before the call goes out."""
    n = (c.last.n if c.last else 0) + 1
    return replace(c, attempts=(*c.attempts, Attempt(n, verb, Phase.CALLING, wall, mono))[-MAX_ATTEMPTS_KEPT:],
                   calls=c.calls + 1, confirmed=None)


def answered(c: Confirm, kind: str, answer: str) -> Confirm:
    """The call came back: "accepted", "refused" (4xx), "failed" (not sent, 5xx) or "unknown" (no answer:
    it may have been carried out, so the state is read as after an accepted call)."""
    a = c.last
    if a is None or a.phase != Phase.CALLING:
        return c
    phase = {"accepted": Phase.CALLED, "unknown": Phase.CALLED, "refused": Phase.REFUSED}.get(kind, Phase.FAILED)
    return _with_last(c, replace(a, phase=phase, answer=answer[:300]))


def seen(c: Confirm, word: str, stopped: bool, gone: bool, wall: float) -> Confirm:
    """A state read: a stop is confirmed once compute no longer bills (or the machine is gone); a
    terminate only once the machine is gone (a stopped one still bills its disk)."""
    a = c.last
    if a is None or a.phase not in OPEN:
        return c
    done = gone or (stopped and a.verb == "stop")
    a = replace(a, state=word[:60], read_at=wall, reads=a.reads + 1, read_error="",
                phase=Phase.CONFIRMED if done else a.phase)
    return replace(_with_last(c, a), confirmed={"state": word[:60], "at": wall} if done else None)


def unread(c: Confirm, error: str, wall: float) -> Confirm:
    a = c.last
    if a is None or a.phase not in OPEN:
        return c
    return _with_last(c, replace(a, read_error=error[:300], read_at=wall, reads=a.reads + 1))


def still_billing(c: Confirm) -> Confirm:
    a = c.last
    if a is None or a.phase not in OPEN:
        return c
    return _with_last(c, replace(a, phase=Phase.STILL_BILLING))


@dataclass(frozen=True)
class Reading:
    """How often to read the state: often enough to confirm soon, rarely enough for a rate limit."""

    every: float = field(default=5.0)

    @classmethod
    def of(cls, confirm_within: float) -> Reading:
        return cls(min(10.0, max(0.2, confirm_within / 30.0)))
