"""When to act on a cap, and what to say before: pure functions of the caps, the lead time, what is
known of the run, and `now` (wall time and seconds since boot, both handed in).

The money a provider bills is the machine's uptime at `price_per_hour`, so every cap is a moment:
- `max_cost`: boot + max_cost / price_per_hour hours;
- `deadline`: the moment itself;
- `max_runtime`: boot + max_runtime.
The earliest of them is *the* cap. The stop must be over before it, so the daemon acts at
cap - lead, where lead = measured save time + stop_grace + expected final-sync time + margin.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from supervisor.states import CAP_KINDS

KINDS = CAP_KINDS
REWARN_CHANGE = 0.10  # mail the projection again when it moves by more than this fraction


@dataclass(frozen=True)
class Caps:
    max_cost: float | None = None
    deadline: float | None = None      # wall-clock epoch seconds
    max_runtime: float | None = None   # seconds since boot
    warn_at: float = 0.8
    price_per_hour: float | None = None
    currency: str = "USD"

    @property
    def any(self) -> bool:
        return self.deadline is not None or self.max_runtime is not None or (
            self.max_cost is not None and bool(self.price_per_hour))


@dataclass(frozen=True)
class Lead:
    """Seconds a clean stop needs between the moment it begins and the cap."""

    save_s: float = 0.0        # the training's save, as measured on its last checkpoint
    stop_grace: float = 30.0   # training.stop_grace: the wait after SIGINT
    final_sync_s: float = 0.0  # expected: what is left to upload plus the save, at the measured rate
    margin: float = 300.0

    @property
    def total(self) -> float:
        return max(0.0, self.save_s) + max(0.0, self.stop_grace) + max(0.0, self.final_sync_s) + max(0.0, self.margin)


@dataclass(frozen=True)
class Run:
    """What is known of the training now (None = unknown)."""

    alive: bool = False
    step: int | None = None
    steps_per_s: float | None = None
    eta_s: float | None = None          # seconds to the end of the run
    checkpoint_every: int | None = None  # steps between the last two checkpoints
    last_checkpoint: int | None = None


@dataclass(frozen=True)
class Cap:
    kind: str
    at: float       # wall moment the cap is reached
    act_at: float   # at - lead: when the stop begins
    value: float    # the cap as configured (money, epoch seconds, seconds since boot)

    @property
    def key(self) -> str:
        """Stable while the cap is unchanged (`at` of a money cap wobbles with the uptime reading)."""
        return f"{self.kind}={self.value:g}"


@dataclass(frozen=True)
class Projection:
    cap: Cap
    used: float                        # fraction of the cap used (0..)
    spent: float | None                # money since boot
    need_cost: float | None            # money the run needs to its end, since boot
    eta_at: float | None               # wall moment the run would end
    fits: bool | None                  # the run ends before the stop must begin
    last_checkpoint: int | None        # the newest checkpoint expected before the stop begins
    need: float | None                 # the figure a re-warning compares: money, or seconds since boot


@dataclass(frozen=True)
class MoneyState:
    warned_need: float | None = None   # the projection figure last mailed
    warned_key: str = ""               # ... for this cap ("" = no warning yet)
    warned_at: float | None = None
    acted: str = ""                    # the cap key a stop was asked for (never asked twice)
    acted_at: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> MoneyState:
        if not isinstance(d, dict):
            return cls()
        known = {k: d[k] for k in ("warned_need", "warned_key", "warned_at", "acted", "acted_at") if k in d}
        return cls(**known)


@dataclass(frozen=True)
class Warn:
    projection: Projection
    again: bool


@dataclass(frozen=True)
class Act:
    cap: Cap
    projection: Projection


def spent(price_per_hour: float | None, uptime_s: float) -> float | None:
    return None if price_per_hour is None else price_per_hour * max(0.0, uptime_s) / 3600.0


def moments(caps: Caps, now_wall: float, uptime_s: float) -> dict[str, float]:
    """kind -> the wall moment each configured cap is reached."""
    boot = now_wall - max(0.0, uptime_s)
    out: dict[str, float] = {}
    if caps.max_cost is not None and caps.price_per_hour:
        out["max_cost"] = boot + caps.max_cost / caps.price_per_hour * 3600.0
    if caps.deadline is not None:
        out["deadline"] = caps.deadline
    if caps.max_runtime is not None:
        out["max_runtime"] = boot + caps.max_runtime
    return out


def first_cap(caps: Caps, lead: Lead, now_wall: float, uptime_s: float) -> Cap | None:
    m = moments(caps, now_wall, uptime_s)
    if not m:
        return None
    kind = min(m, key=lambda k: (m[k], KINDS.index(k)))
    value = {"max_cost": caps.max_cost, "deadline": caps.deadline, "max_runtime": caps.max_runtime}[kind]
    return Cap(kind, m[kind], m[kind] - lead.total, float(value or 0.0))


def used(cap: Cap, now_wall: float, uptime_s: float) -> float:
    """The fraction of the cap gone: machine time since boot over the time from boot to the cap
    (for money the same as spent / max_cost)."""
    boot = now_wall - max(0.0, uptime_s)
    span = cap.at - boot
    return 1.0 if span <= 0 else max(0.0, (now_wall - boot) / span)


def checkpoint_before(run: Run, moment: float, now_wall: float) -> int | None:
    """The newest checkpoint expected by `moment` at the present rate (None = cannot say)."""
    if run.step is None or not run.checkpoint_every or run.checkpoint_every <= 0:
        return run.last_checkpoint
    step = run.step
    if run.alive and run.steps_per_s and moment > now_wall:
        step = run.step + run.steps_per_s * (moment - now_wall)
    n = int(math.floor(step / run.checkpoint_every)) * run.checkpoint_every
    return max(n, run.last_checkpoint or 0) or run.last_checkpoint


def project(caps: Caps, lead: Lead, run: Run, now_wall: float, uptime_s: float) -> Projection | None:
    cap = first_cap(caps, lead, now_wall, uptime_s)
    if cap is None:
        return None
    money = spent(caps.price_per_hour, uptime_s)
    eta_at = now_wall + run.eta_s if run.alive and run.eta_s is not None else None
    need_cost = None
    if eta_at is not None and caps.price_per_hour is not None:
        need_cost = spent(caps.price_per_hour, uptime_s + (eta_at - now_wall))
    fits = None if eta_at is None else eta_at <= cap.act_at
    if cap.kind == "max_cost":
        need = need_cost
    else:
        need = None if eta_at is None else uptime_s + (eta_at - now_wall)
    return Projection(cap, used(cap, now_wall, uptime_s), money, need_cost, eta_at, fits,
                      checkpoint_before(run, cap.act_at, now_wall) if run.alive else run.last_checkpoint, need)


def changed(old: float | None, new: float | None) -> bool:
    if old is None or new is None:
        return False
    return abs(new - old) > REWARN_CHANGE * max(abs(old), 1e-9)


def decide(st: MoneyState, caps: Caps, lead: Lead, run: Run, now_wall: float,
           uptime_s: float) -> tuple[MoneyState, list[Warn | Act]]:
    """One look: warn (at warn_at, again when the projection moves > 10 %), act (at cap - lead, once
    per cap; a cap moved by `supervisorctl budget` is a new cap)."""
    p = project(caps, lead, run, now_wall, uptime_s)
    if p is None:
        return st, []
    out: list[Warn | Act] = []
    if now_wall >= p.cap.act_at:
        if st.acted != p.cap.key:
            if st.warned_key != p.cap.key:
                # a cap set (or moved) too close for warn_at: the owner still hears the projection first
                out.append(Warn(p, again=False))
                st = replace(st, warned_key=p.cap.key, warned_need=p.need, warned_at=now_wall)
            st = replace(st, acted=p.cap.key, acted_at=now_wall)
            out.append(Act(p.cap, p))
        return st, out
    if p.used >= caps.warn_at:
        first = st.warned_key != p.cap.key
        if first or changed(st.warned_need, p.need):
            st = replace(st, warned_key=p.cap.key, warned_need=p.need, warned_at=now_wall)
            out.append(Warn(p, again=not first))
        elif st.warned_need is None and p.need is not None:
            st = replace(st, warned_need=p.need)  # the first figure known after a warning without one
    return st, out


def withdrawn(st: MoneyState, caps: Caps, lead: Lead, now_wall: float, uptime_s: float) -> tuple[MoneyState, str]:
    """A cap a stop was asked for, moved (`supervisorctl budget`, or gone) so that no stop is due
    now: the kind the stop was asked with (its wing withdraws it) and a state that acts again when
    the moved cap comes; "" while the stop still has its cause (the same cap, or one due now). The
    lead alone moving (the final sync sending what was pending) never withdraws a stop."""
    if not st.acted:
        return st, ""
    cap = first_cap(caps, lead, now_wall, uptime_s)
    if cap is not None and (cap.key == st.acted or now_wall >= cap.act_at):
        return st, ""
    return replace(st, acted="", acted_at=None), st.acted.split("=", 1)[0]


def cut_in(cap: Cap | None, now_wall: float, reserve_s: float) -> float | None:
    """Seconds a final sync may still take before the cap's moment (keeping `reserve_s` for the
    action itself); None = no cap."""
    if cap is None:
        return None
    return max(0.0, cap.at - reserve_s - now_wall)
