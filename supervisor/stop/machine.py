"""The stop machine: STOPPING -> STOPPED, and the reasons that stand, as pure functions.

One record is kept for the two machines of a poll (idle.json: a restart and an upgrade read it as
before): the idle machine (idle/machine.py) owns ACTIVE/IDLE/WARNED and the idle clock; this module
owns the record's stop fields: `state` once it is STOPPING or STOPPED, `stop_reason` (the word of the
stop under way), `committed`, `resettable` and `pending` (the standing reasons, stop.sequence). The
idle machine lands every request in `pending` (the pure door, `sequence.request`) and, when the
decision (`sequence.advance`) says so, calls `begin` here; a stop that ends hands the record back to
the idle machine (`ended`), which starts its clock again. The moves after the begin (`commit`,
`failed`, `stopped`) are the stop driver's (stop/driver.py), each under the guard's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from supervisor.states import IdleState, check_idle_move
from supervisor.stop import sequence as stops
from supervisor.stop.rules import stop_rule
from supervisor.stop.sequence import Standing

I = IdleState  # noqa: E741


class Refused(Exception):
    """A request that cannot be honoured now; the message says why."""


class Record(Protocol):
    """The fields of the record this machine reads and writes."""

    state: IdleState
    cycle: int
    stop_reason: str
    committed: bool
    resettable: bool
    pending: list[dict]
    keepalive_mono: float | None
    keepalive_until: float | None


R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class BeginStop:
    cycle: int
    reason: str  # the word it was asked with (idle, finished, max_cost, gpu_bad, ...)


@dataclass(frozen=True)
class AbortStop:
    """A stop that had not begun its action was cancelled (activity, its reason withdrawn, or a
    higher reason taking it over); tell the stop sequence."""

    cycle: int
    why: str = ""


def standing(m: Record) -> tuple[Standing, ...]:
    return tuple(Standing.from_json(d) for d in m.pending)


def stand(m: Record, held: tuple[Standing, ...]) -> None:
    m.pending = [{"word": x.word, "why": x.why, "since": x.since} for x in held]


def stopping(m: Record) -> bool:
    return m.state == I.STOPPING


def begin(m: Record, word: str, own_notice: bool) -> list[AbortStop | BeginStop]:
    """STOPPING for `word` (the caller took the decision: sequence.advance). `own_notice`: the stop
    follows the notice that counted for it, and keeps that notice's cycle (its mails' keys). A stop
    under way for another reason is taken over: its record ends, a new one begins."""
    out: list[AbortStop | BeginStop] = []
    if m.state == I.STOPPING and m.stop_reason != word:
        out.append(AbortStop(m.cycle, f"taken over: {stop_rule(word).words}"))
    if not own_notice:
        m.cycle += 1
    check_idle_move(m.state, I.STOPPING)
    m.state = I.STOPPING
    m.stop_reason = word
    if not stop_rule(word).keepalive_moves:
        m.keepalive_mono = m.keepalive_until = None
    m.resettable = False
    out.append(BeginStop(m.cycle, word))
    return out


def ended(m: Record) -> str:
    """The stop under way lost its reason (withdrawn by its wing) and nothing else is ready: why, in
    the words of the cancel mail and the record."""
    rule = stop_rule(m.stop_reason)
    return f"{rule.words}: withdrawn" + (f" ({rule.withdrawn_by})" if rule.withdrawn_by else "")


def keepalive_refusal(m: Record) -> str:
    """Why `keepalive` cannot move the stop (""): it acts already, it ran, or the table says so."""
    if m.committed:
        return "too late: the stop action has already begun"
    if m.state == I.STOPPED and not m.resettable:
        return "the machine was already stopped"
    rule = stop_rule(m.stop_reason)
    if m.state == I.STOPPING and not rule.keepalive_moves:
        then = f"; {rule.withdrawn_by} withdraws it" if rule.withdrawn_by else ""
        return f"the machine is stopping ({rule.words}), which keepalive does not move{then}"
    return ""


def on_activity(m: Record) -> None:
    """Activity came: the reasons the table lets activity cancel stop standing."""
    stand(m, stops.on_activity(standing(m)))


def commit(m: R) -> R:
    """The stop action is about to run; from here on activity no longer cancels."""
    if m.state != I.STOPPING:
        raise Refused(f"not stopping (state {m.state.value})")
    return replace(m, committed=True)  # type: ignore[type-var]


def failed(m: R) -> R:
    """The action ran and failed: the machine is still up, so activity may cancel again."""
    return replace(m, committed=False)  # type: ignore[type-var]


def stopped(m: R, dry_run: bool) -> R:
    """The action ran: every reason that stood is served by it (a dry run's may start over)."""
    check_idle_move(m.state, I.STOPPED)
    return replace(m, state=I.STOPPED, committed=False, resettable=dry_run, pending=[])  # type: ignore[type-var]
