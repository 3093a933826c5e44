"""Words for the caps (supervisor.money) and the hooks: the projection warning, the stop for a cap,
what `supervisorctl budget` now means, and a hook that failed."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.durations import format_duration
from supervisor.notify.mails import Mail
from supervisor.timefmt import hm, when

CAP_NAMES = {"max_cost": "spend cap", "deadline": "deadline", "max_runtime": "runtime cap"}


@dataclass(frozen=True)
class Projected:
    kind: str                    # max_cost | deadline | max_runtime
    cap_text: str                # "50.00 USD", "2026-12-05 08:00:00 UTC", "10h since boot"
    cap_at: float                # when the cap is reached
    act_at: float                # when the stop begins
    lead_s: float                # the time the stop is given
    currency: str = "USD"
    spent: float | None = None
    need_cost: float | None = None
    eta_at: float | None = None
    fits: bool | None = None
    last_checkpoint: int | None = None
    used: float = 0.0


def money(x: float | None, currency: str) -> str:
    return "?" if x is None else f"{x:.2f} {currency}"


def projection_line(p: Projected) -> str:
    """'at this rate the run needs 62.00 USD (ETA 14:20); the cap of 50.00 USD is reached at 12:10;
    the last checkpoint before then will be about checkpoint-1800'."""
    parts = []
    if p.eta_at is not None:
        need = money(p.need_cost, p.currency) if p.kind == "max_cost" or p.need_cost is not None else "?"
        parts.append(f"at this rate the run needs {need} (ETA {hm(p.eta_at)})")
    else:
        parts.append("the run's end cannot be projected yet (no ETA)")
    parts.append(f"the {CAP_NAMES[p.kind]} of {p.cap_text} is reached at {hm(p.cap_at)}")
    if p.last_checkpoint is not None:
        parts.append(f"the last checkpoint before then will be about checkpoint-{p.last_checkpoint}")
    return "; ".join(parts)


def warning(p: Projected, again: bool) -> Mail:
    name = CAP_NAMES[p.kind]
    verdict = ("the run ends before the stop" if p.fits else
               "the run will NOT finish before the cap" if p.fits is False else "the run's end is unknown")
    subject = (f"{'projection changed: ' if again else ''}{name} {p.cap_text}: "
               f"{'fits' if p.fits else 'stops before the end' if p.fits is False else 'at ' + hm(p.cap_at)}")
    line = projection_line(p)
    body = (f"{line[:1].upper()}{line[1:]}.\n\n"
            f"Used so far: {p.used * 100:.0f} % of the {name}"
            + (f" ({money(p.spent, p.currency)} since boot)" if p.spent is not None else "") + ".\n"
            f"Verdict: {verdict}.\n\n"
            f"At {when(p.act_at)} ({format_duration(p.lead_s)} before the cap) the daemon interrupts the "
            "training (it saves on SIGINT), syncs and verifies the newest save, and runs the stop action, "
            "so the work is off the machine before the cap.\n"
            "`supervisorctl keepalive` does not move a cap. To change it (root): "
            "`supervisorctl budget +20` or `supervisorctl budget --deadline \"2026-12-05 08:00\"`.\n")
    return Mail(subject, body)


def cap_reason(kind: str, cap_text: str, cap_at: float) -> str:
    """Why the machine stops, for the stopping mail and status: 'the spend cap of 50.00 USD (at 12:10)'."""
    return f"the {CAP_NAMES.get(kind, kind)} of {cap_text} (reached at {hm(cap_at)})"


def hook_failed(event: str, run: str, why: str, output: str, required: bool) -> Mail:
    held = ("It is required, so the stop waits and retries (as after a failed final sync).\n"
            if required and event == "stop" else "")
    return Mail(f"hook for {event} failed: {why[:80]}",
                f"The hook `{run}` run for the event {event!r} {why}.\n{held}"
                f"Its last output:\n{output or '(none)'}\n")
