"""The provider stop carried out (the shell around stop.confirm): one call per attempt, saved before
it goes out, then the provider's state read until it says not billed.

Returns what happened, in words, when the provider confirms; raises StopActionError (the stop
sequence mails it at once and tries again after stop.retry_interval) when the provider refused
(its answer in the message), when the call did not go out, or when the machine still bills after
`confirm_within` (the next attempt calls again). "auto" on a provider where a poweroff ends billing
(AWS, GCP) powers off at once after a refusal instead of waiting: the owner is mailed either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog

from supervisor.durations import format_duration
from supervisor.stop import confirm as cf
from supervisor.stop.choose import Plan
from supervisor.stop.providers.base import ProviderError, StopActionError
from supervisor.timefmt import hm

log = structlog.get_logger("stop")


class Box(Protocol):
    """Where the attempt lives: the stop record (idle.stop.StopRecord.provider), saved at once."""

    def load(self) -> dict | None: ...

    def save(self, d: dict) -> None: ...

    def note(self, text: str) -> None: ...


def _load(box: Box, plan: Plan, verb: str, wall: float, mono: float) -> cf.Confirm:
    raw = box.load()
    inst = getattr(plan.provider, "instance", "")
    name = plan.found.name if plan.found else ""
    if raw is None:
        return cf.Confirm(name, inst)
    try:
        return cf.Confirm.from_json(raw)
    except ValueError as e:
        box.note(f"{e}: an attempt may be in flight, so its state is read before any call")
        return cf.unknown_in_flight(name, inst, verb, wall, mono)


def carry_out(plan: Plan, box: Box, *, verified_why: str, poweroff: Callable[[], str], confirm_within: float,
              wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> str:
    if plan.action == "poweroff":
        return poweroff() + (f" (warning: {plan.warning})" if plan.warning else "")
    p, info = plan.provider, plan.info
    if p is None or info is None:
        raise StopActionError(plan.problem or f"no provider to call: {plan.credential_why or 'none known here'}")
    verb = "terminate" if plan.mode == "terminate" and not verified_why else "stop"
    if plan.mode == "terminate" and verified_why and not info.can_stop:
        raise StopActionError(f"terminate held back: {verified_why}; and {info.label} has no stop, so the "
                              f"{info.noun} keeps running (and billing) until the work is verified on the target")
    c = _load(box, plan, verb, wall(), mono())
    said = ""
    if cf.next_step(c, mono(), confirm_within) == cf.Step.CALL:
        if verb == "stop" and plan.mode == "terminate":
            said = f"terminate held back ({verified_why}): stopping instead; "
            box.note(said.rstrip("; "))
        c = cf.begin(c, verb, wall(), mono())
        box.save(c.to_json())  # before the call: a restart from here on reads, never calls again
        log.warning("stop_provider_call", provider=info.name, verb=verb, attempt=c.last.n if c.last else 0)
        try:
            text = p.terminate() if verb == "terminate" else p.stop()
            c = cf.answered(c, "accepted", text)
            box.note(text)
        except ProviderError as e:
            c = cf.answered(c, e.kind, e.answer or str(e))
            box.save(c.to_json())
            if e.kind != "unknown":
                return _refused(plan, e, poweroff)
            box.note(f"{e}: it may have been carried out; reading the state")
        box.save(c.to_json())
    else:
        a = c.last
        if a is not None and a.phase in cf.OPEN:
            box.note(f"resuming attempt {a.n} ({a.verb}, {a.phase.value}): reading the state, no second call")
            verb = a.verb
    return _confirm(plan, box, c, said, confirm_within, wall, mono, sleep)


def _refused(plan: Plan, e: ProviderError, poweroff: Callable[[], str]) -> str:
    info = plan.info
    assert info is not None
    if plan.configured == "auto" and info.poweroff_ends_billing and e.kind == "refused":
        log.error("stop_provider_refused_poweroff_instead", provider=info.name, error=str(e))
        return f"{info.label} refused the stop ({e}); powered off instead, which ends compute billing there: " + poweroff()
    what = "refused" if e.kind == "refused" else "failed"
    raise StopActionError(f"{info.label} {what} the stop: {e}")


def _confirm(plan: Plan, box: Box, c: cf.Confirm, said: str, confirm_within: float, wall: Callable[[], float],
             mono: Callable[[], float], sleep: Callable[[float], None]) -> str:
    info, p = plan.info, plan.provider
    assert info is not None and p is not None
    every = cf.Reading.of(confirm_within).every
    while True:
        step = cf.next_step(c, mono(), confirm_within)
        a = c.last
        if step == cf.Step.DONE and c.confirmed is not None:
            box.save(c.to_json())
            did = (a.answer if a and a.answer else
                   f"{info.label} API: {a.verb if a else 'stop'} {plan.instance_words or p.instance}")
            text = f"{said}{did}; confirmed {c.confirmed['state']} at {hm(c.confirmed['at'])}"
            log.warning("stop_provider_confirmed", provider=info.name, state=c.confirmed["state"])
            return text
        if step == cf.Step.STILL_BILLING:
            c = cf.still_billing(c)
            box.save(c.to_json())
            last = (a.state or "unknown") if a else "unknown"
            err = f" (the state could not be read: {a.read_error})" if a and a.read_error and not a.state else ""
            raise StopActionError(f"still billing: {info.label} still reports {plan.instance_words or p.instance} "
                                  f"{last} {format_duration(confirm_within)} after the {a.verb if a else 'stop'}"
                                  f"{err}; the stop is made again")
        if step == cf.Step.CALL:  # the attempt ended while reading (cannot happen; never call from here)
            raise StopActionError(f"{info.label}: the stop attempt ended unconfirmed")
        before = a.state if a else ""
        try:
            s = p.state()
            c = cf.seen(c, s.word, s.stopped, s.gone, wall())
        except ProviderError as e:
            c = cf.unread(c, str(e), wall())
        now = c.last
        if c.confirmed is None and now is not None and (now.state != before or now.reads == 1):
            box.save(c.to_json())  # a change is kept; the same word read again is not written again
        if c.confirmed is None:
            sleep(every)
