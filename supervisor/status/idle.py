"""The `idle` and `stop` blocks (idle/facts.py status_of): the idle clock, and the one stop sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.durations import format_duration
from supervisor.states import IdleState
from supervisor.status import Block, Metric, Record, View, enum, gauge
from supervisor.timefmt import clock, hm

IDLE_STATES = [s.value for s in IdleState]


@dataclass
class IdleBlock(Block):
    KEY = "idle"
    state: str | None = None
    mode: str | None = None
    idle_since: float | None = None
    idle_for_s: float | None = None
    warn_at: float | None = None
    stop_at: float | None = None
    reasons: list[str] = field(default_factory=list)
    checked: list[object] = field(default_factory=list)
    keepalive_until: float | None = None
    warn_after_s: float | None = None
    stop_after_warning_s: float | None = None
    finish_grace_s: float | None = None
    idle_cost: float | None = None
    currency: str | None = None
    training_stalled: bool | None = None

    def lines(self, view: View) -> list[str]:
        """The idle clock, then the stop (the `stop` block) as far as it concerns the person reading."""
        s, now = view.block(StopBlock), view.now
        state = self.state if self.state is not None else "?"
        out = []
        if state == "ACTIVE":
            out.append(f"idle      ACTIVE  {'; '.join(self.reasons) or 'starting up'}")
            if self.mode == "finish":
                out.append(f"          training ended: stops {format_duration(self.finish_grace_s or 0)} after "
                           "the last activity ends")
            else:
                out.append(f"          warns {format_duration(self.warn_after_s or 0)} after the last activity, "
                           f"stops {format_duration(self.stop_after_warning_s or 0)} after the warning")
        elif state == "IDLE":
            out.append(f"idle      IDLE for {format_duration(self.idle_for_s or 0)} (since {hm(self.idle_since)})  "
                       f"warn {clock(self.warn_at, now)}  stop {clock(self.stop_at, now)}")
        elif state == "WARNED":
            head = "training ended, grace" if self.mode == "finish" else f"warned {hm(self.warn_at)}"
            out.append(f"idle      WARNED  {head}  stop {clock(self.stop_at, now)}  prevent: supervisorctl keepalive 2h")
        else:
            out.append(f"idle      {state}  ({s.reason or 'idle'})  stop {s.action}  phase {s.phase or '-'}")
        if self.idle_cost:
            out.append(f"          idle cost so far {self.idle_cost:.2f} {self.currency or ''}".rstrip())
        if self.training_stalled and state != "ACTIVE" and s.phase != "interrupting":
            out.append("          training is still running but looks stalled (no GPU load, no log output)")
        return out + s.stop_lines(state)

    def metrics(self, view: View) -> list[Metric]:
        out = enum("idle_state", "Idle protection state: 1 for the current one.", self.state, IDLE_STATES)
        if self.state and view.now_known:
            since = self.idle_since
            out.append(gauge("idle_seconds", "How long the machine has been idle (0 while active).",
                             max(view.now - since, 0.0) if since is not None else 0))
        return [*out, gauge("idle_warn_timestamp_seconds", "When the idle warning goes (or went) out.", self.warn_at),
                gauge("idle_stop_timestamp_seconds", "When an idle stop is planned.", self.stop_at),
                gauge("keepalive_until_timestamp_seconds", "Until when a keepalive holds the machine.",
                      self.keepalive_until)]


@dataclass
class Provider(Record):
    """The provider's stop (issue 52): who bills, what a stop ends there, what still bills."""

    name: str | None = None
    label: str | None = None
    detected_by: str | None = None
    instance: str | None = None
    mode: str | None = None
    action: str | None = None
    via: str | None = None
    ends_billing: bool | None = None
    still_billed: str | None = None
    price_per_hour: float | None = None
    line: str | None = None
    warning: str | None = None
    problem: str | None = None
    credential: str | None = None


@dataclass
class Confirmed(Record):
    state: str | None = None
    at: float | None = None


@dataclass
class FinalSync(Record):
    """interfaces.FinalSyncResult as the stop record keeps it."""

    ok: bool | None = None
    target: str | None = None
    files: int | None = None
    bytes: int | None = None
    uploaded_files: int | None = None
    error: str | None = None
    unsynced: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    partial_units: list[str] = field(default_factory=list)
    unsynced_units: list[str] = field(default_factory=list)
    newest: list[str] = field(default_factory=list)
    unselected: list[str] = field(default_factory=list)
    unselected_files: int | None = None
    unselected_bytes: int | None = None
    unselected_hold: bool | None = None
    finals: list[str] = field(default_factory=list)


@dataclass
class StopBlock(Block):
    KEY = "stop"
    action: str | None = None
    how: str | None = None
    provider: Provider | None = None
    confirmed: Confirmed | None = None
    planned_at: float | None = None
    phase: str | None = None
    reason: str | None = None
    pending: list[object] = field(default_factory=list)
    attempts: int | None = None
    last_error: str | None = None
    final_sync: FinalSync | None = None
    result: str | None = None
    final_sync_paths: list[str] = field(default_factory=list)
    interrupted_run: int | None = None
    interrupted_at: float | None = None
    interrupt_ended: str | None = None

    def stop_lines(self, idle_state: str) -> list[str]:
        """What the idle lines add of the stop: a final sync sent as it was, the interrupt, the
        provider's stop and what still bills, its confirmation, the last result or error."""
        out = []
        fs = self.final_sync or FinalSync()
        if fs.ok and (fs.damaged or fs.partial_units):
            named = [*fs.partial_units, *fs.damaged]
            out.append(f"stop      final sync sent as they are: {'; '.join(named[:3])}"
                       + (f" and {len(named) - 3} more" if len(named) > 3 else ""))
        if self.phase == "interrupting":
            out.append(f"stop      interrupting run {self.interrupted_run} (since {hm(self.interrupted_at)}) "
                       "so it can save; the final sync follows its end")
        pv = self.provider or Provider()
        if pv.line and pv.name:  # the provider's stop and what still bills after it (issue 52)
            out.append(f"stop      {pv.line}")
            if "cannot work here" in (self.how or ""):
                out.append(f"          stops {self.how}")
        elif self.how and idle_state in ("ACTIVE", "IDLE", "WARNED"):
            out.append(f"          stops {self.how}")
        out += [f"          WARNING: {w}" for w in (pv.warning, pv.problem) if w]
        if self.confirmed is not None and self.confirmed.filled:
            out.append(f"stop      confirmed by the provider: {self.confirmed.state} at {hm(self.confirmed.at)}")
        if self.last_error:
            out.append(f"stop      {self.last_error[:200]}")
        elif self.result:
            out.append(f"stop      {self.result[:200]}")
        return out

    def metrics(self, view: View) -> list[Metric]:
        return [gauge("stop_planned_timestamp_seconds", "When the machine is planned to stop.", self.planned_at)]
