"""The `alerts` block (the active alerts) and the `notify` block (where they go), notify/alerts.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.status import Block, Metric, Record, View, gauge
from supervisor.timefmt import clock


@dataclass
class Alert(Record):
    key: str | None = None
    kind: str | None = None
    severity: str | None = None
    subject: str | None = None
    since: float | None = None
    mails: int | None = None
    last_mailed: float | None = None


@dataclass
class AlertsBlock(Block):
    """Top-level `alerts`: the active ones."""

    alerts: list[Alert] = field(default_factory=list)

    def lines(self, view: View) -> list[str]:
        if not self.alerts:
            return ["alerts    none active"]
        return [f"alert     [{a.severity}] {a.subject} (since {clock(a.since, view.now)})" for a in self.alerts[:5]]

    def metrics(self, view: View) -> list[Metric]:
        counts: dict[tuple[str, str], int] = {}
        for a in self.alerts:
            k = (str(a.kind or "unknown"), str(a.severity or "warning"))
            counts[k] = counts.get(k, 0) + 1
        return [gauge("alerts_active", "Alerts active now (all kinds).", sum(counts.values())),
                *(gauge("alerts_active_by_kind", "Alerts active now, by kind and severity.", n,
                        {"kind": kind, "severity": sev}) for (kind, sev), n in sorted(counts.items()))]


@dataclass
class Channel(Record):
    name: str | None = None
    kind: str | None = None
    target: str | None = None
    state: str | None = None
    queued: int | None = None
    sent: int | None = None
    failures: int | None = None
    last_ok_at: float | None = None
    last_failed_at: float | None = None
    failing_since: float | None = None
    last_error: str | None = None
    next_try: float | None = None


@dataclass
class NotifyBlock(Block):
    KEY = "notify"
    channels: list[Channel] = field(default_factory=list)

    def lines(self, view: View) -> list[str]:
        """Where alerts go (or that they go nowhere but here), then a line per failing channel."""
        out = []
        if self.given:
            chans = self.channels
            out.append("notify    " + (", ".join(f"{c.kind or c.name} ({c.target})" for c in chans)
                                      if chans else "none: alerts reach only `supervisorctl alerts` and the log; "
                                      "add [email] or [notify]"))
        for ch in self.channels:
            if ch.state != "failing":
                continue
            retry = f", retry {clock(ch.next_try, view.now)}" if ch.next_try else ""
            out.append(f"notify    {ch.name} ({ch.target}) FAILING since {clock(ch.failing_since, view.now)}: "
                       f"{ch.last_error}; {ch.queued if ch.queued is not None else 0} queued{retry}")
        return out

    def metrics(self, view: View) -> list[Metric]:
        out = []
        for ch in self.channels:
            lab = {"channel": ch.name or "", "kind": ch.kind or ""}
            out += [gauge("notify_channel_up", "0 while a notification channel fails to deliver.",
                          ch.state != "failing", lab),
                    gauge("notify_queued", "Messages waiting for the channel.", ch.queued, lab),
                    gauge("notify_last_success_timestamp_seconds", "When the channel last delivered.",
                          ch.last_ok_at, lab)]
        return out
