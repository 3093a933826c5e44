"""The `preemption` block (spot/guard.py): a spot notice on this machine, or one a previous machine got."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.status import Block, Record, View
from supervisor.timefmt import clock


@dataclass
class Notice(Record):
    """spot/decide.py NoticeRecord."""

    provider: str | None = None
    kind: str | None = None
    detail: str | None = None
    noticed_at: float | None = None
    deadline: float | None = None
    boot_id: str | None = None
    hostname: str | None = None
    signal: str | None = None
    signal_error: str | None = None
    newest_at_notice: str | None = None
    newest: str | None = None
    newest_on_target: bool | None = None
    newest_off_at: float | None = None
    made_it: list[str] = field(default_factory=list)
    not_made: list[str] = field(default_factory=list)
    outcome: str | None = None
    outcome_at: float | None = None
    told: bool | None = None
    told_next_boot: bool | None = None


@dataclass
class PreemptionBlock(Block):
    KEY = "preemption"
    watch: list[str] = field(default_factory=list)
    detected: list[str] | None = None
    error: str | None = None
    training_signal: str | None = None
    notice: Notice | None = None
    previous: Notice | None = None

    def lines(self, view: View) -> list[str]:
        now, out = view.now, []
        n = self.notice
        if n is not None and n.filled:
            newest = n.newest or n.newest_at_notice or "no complete checkpoint"
            where = "on the target" if n.newest_on_target else "NOT on the target yet"
            result = {"synced": "everything complete is on the target", "deadline": "time ran out",
                      "exited": "the daemon exited first"}.get(n.outcome or "", "emergency sync running")
            out.append(f"preempt   NOTICE ({n.provider} {n.kind}) at {clock(n.noticed_at, now)}; "
                       f"machine goes {clock(n.deadline, now)}; newest {newest} {where}; {result}")
            if n.not_made:
                out.append(f"          not on the target: {', '.join(n.not_made[:5])}")
        prev = self.previous
        if prev is not None and prev.filled:
            newest = prev.newest or "no complete checkpoint"
            made = "made it" if prev.newest_on_target else "did NOT make it"
            out.append(f"preempt   the previous machine was preempted at {clock(prev.noticed_at, now)}; "
                       f"newest {newest} {made}")
        return out
