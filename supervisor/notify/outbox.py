"""The alert outbox as data: severities, records, queued mails, per-channel health, and the pure
decisions over them (`plan`: what is due now; `queue`: one copy per channel; retry times), with
the loaders that read them back from `alerts.json`. No I/O, no clock: every function is handed
`now`. The shell that sends and persists is alerts.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Protocol

import structlog

from supervisor.config import AlertsConfig
from supervisor.timefmt import when

log = structlog.get_logger("alerts")


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


# Lifecycle notices are mailed even when the hourly cap is reached: the owner must hear that the
# machine is about to stop (or did), and there are at most a handful of them per idle cycle.
UNCAPPED_KINDS = frozenset({"idle_warning", "stop_cancelled", "stopping", "training_finished",
                            "training_failed", "stop_failed",
                            # a spot notice leaves seconds: it cannot wait for the next hour's budget
                            "preemption", "preemption_outcome", "preempted_previous",
                            # a BAD machine may be stopped right after it (health.on_bad = "stop")
                            "gpu_health",
                            # the disk fills before the next saves: a cap must not hold it past the save that fails
                            "disk_forecast"})


# An alert mailed by a daemon that then restarted is remembered; if no subsystem reports it again
# within this long after the restart, it is taken as cleared (and said so), never reminded forever.
STALE_AFTER_RESTART = 900.0
# Cleared records are forgotten after this long (at least two repeat intervals, for dedup).
FORGET_AFTER = 86400.0
# Mails waiting for a server that stays down: the oldest capped ones go first beyond this (per channel).
OUTBOX_MAX = 100
DEFAULT_CHANNEL = "email"


@dataclass
class Record:
    key: str
    kind: str
    severity: str
    subject: str
    body: str
    condition: bool
    first_seen: float
    last_seen: float
    active: bool = True
    last_mailed: float | None = None
    mails: int = 0
    resolved_at: float | None = None
    resolve_pending: bool = False
    stale_since: float | None = None
    resolve_note: str = ""


@dataclass
class Mail:
    key: str
    kind: str
    subject: str
    body: str
    created: float
    attempts: int = 0
    next_try: float = 0.0
    last_error: str = ""
    uncapped: bool = False
    # A reminder or a one-off event mail says nothing a newer mail for the same key does not:
    # while the server is down it is replaced instead of piling up.
    replaceable: bool = False
    channel: str = DEFAULT_CHANNEL
    severity: str = "warning"
    state: str = "event"  # firing | reminder | resolved | event (what chat and webhooks are told)


@dataclass
class ChannelState:
    """One channel's health, kept across restarts and shown in status."""

    last_ok_at: float | None = None
    last_failed_at: float | None = None
    last_error: str = ""
    failures: int = 0  # in a row; 0 once a delivery works again
    sent: int = 0
    failing_since: float | None = None


@dataclass
class AlertState:
    records: dict[str, Record] = field(default_factory=dict)
    outbox: list[Mail] = field(default_factory=list)
    sent_times: dict[str, list[float]] = field(default_factory=dict)  # per channel, for the hourly cap
    channels: list[str] = field(default_factory=lambda: [DEFAULT_CHANNEL])
    health: dict[str, ChannelState] = field(default_factory=dict)


def queue(state: AlertState, mail: Mail) -> list[Mail]:
    """Put one copy of `mail` per channel in the outbox, superseding queued replaceable mails for
    its key on that channel and keeping each channel's queue bounded. Returns the mails dropped."""
    mail.uncapped = mail.kind in UNCAPPED_KINDS
    dropped: list[Mail] = []
    for ch in state.channels:
        copy = dataclasses.replace(mail, channel=ch)
        gone = [m for m in state.outbox if m.channel == ch and m.key == mail.key and m.replaceable]
        state.outbox = [m for m in state.outbox if not any(m is g for g in gone)]
        dropped += gone
        state.outbox.append(copy)
        mine = [m for m in state.outbox if m.channel == ch]
        while len(mine) > OUTBOX_MAX:
            victim = next((m for m in mine if not m.uncapped), mine[0])
            state.outbox = [m for m in state.outbox if m is not victim]
            mine = [m for m in mine if m is not victim]
            dropped.append(victim)
    return dropped


def plan(state: AlertState, now: float, cfg: AlertsConfig) -> list[Mail]:
    """Move due records into mails; pure except for mutating `state`. Returns the new mails."""
    new: list[Mail] = []
    for key in list(state.records):
        r = state.records[key]
        if r.active and r.condition and r.stale_since is not None and now - r.stale_since >= STALE_AFTER_RESTART:
            r.active, r.resolved_at, r.resolve_pending = False, now, True
            r.resolve_note = "Not reported again since the daemon restarted; taken as cleared."
        if r.resolve_pending:
            r.resolve_pending = False
            if r.mails > 0:
                note = r.resolve_note or f"Resolved at {when(now)}."
                new.append(Mail(r.key, r.kind, f"RESOLVED: {r.subject}", f"{r.body}\n\n{note}", now,
                                severity=r.severity, state="resolved"))
            continue
        if not r.active:
            if now - r.last_seen >= max(FORGET_AFTER, 2 * cfg.repeat_interval):
                del state.records[key]
            continue
        if not r.condition:
            continue
        if r.last_mailed is None:
            if now - r.first_seen >= cfg.first_delay:
                new.append(Mail(r.key, r.kind, r.subject, r.body, now, severity=r.severity, state="firing"))
                r.last_mailed = now
                r.mails += 1
        elif now - r.last_mailed >= cfg.repeat_interval:
            new.append(Mail(r.key, r.kind, f"STILL: {r.subject}", r.body, now, replaceable=True,
                            severity=r.severity, state="reminder"))
            r.last_mailed = now
            r.mails += 1
    for m in new:
        queue(state, m)
    return new


def due_mails(state: AlertState, now: float, cfg: AlertsConfig) -> list[Mail]:
    """The mails to try now, respecting retry times and each channel's hourly cap."""
    # A send time in the future means the wall clock went back: count it as now, so the cap holds.
    state.sent_times = {ch: [min(t, now) for t in ts if now - t < 3600] for ch, ts in state.sent_times.items()}
    budget: dict[str, int] = {}
    held: set[tuple[str, str]] = set()  # (channel, key) with an earlier mail still waiting
    out = []
    for m in state.outbox:
        if (m.channel, m.key) in held:
            continue  # never a RESOLVED before the first mail it resolves, whatever the retry times
        if m.next_try > now:
            held.add((m.channel, m.key))
            continue
        if m.channel not in budget:
            budget[m.channel] = cfg.max_per_hour - len(state.sent_times.get(m.channel, []))
        if m.uncapped:
            out.append(m)
        elif budget[m.channel] > 0:
            out.append(m)
            budget[m.channel] -= 1
        else:
            held.add((m.channel, m.key))
    return out


def retry_at(now: float, attempts: int, cfg: AlertsConfig) -> float:
    """When a mail that failed `attempts` times is tried again: doubling from retry_interval, at most 1h."""
    return now + min(cfg.retry_interval * (2 ** min(attempts - 1, 6)), 3600)


class Mailer(Protocol):
    def send(self, subject: str, body: str) -> None:
        """Deliver or raise."""


def severity_value(value: Severity | str) -> str:
    try:
        return Severity(value).value
    except ValueError:
        log.error("alert_bad_severity", severity=str(value))
        return Severity.WARNING.value


RECORD_FIELDS = {f.name for f in fields(Record)}
MAIL_FIELDS = {f.name for f in fields(Mail)}
HEALTH_FIELDS = {f.name for f in fields(ChannelState)}


def record_from(d: dict) -> Record:
    r = Record(**{k: v for k, v in d.items() if k in RECORD_FIELDS})
    for name in ("first_seen", "last_seen"):
        setattr(r, name, float(getattr(r, name)))
    for name in ("last_mailed", "resolved_at", "stale_since"):
        if getattr(r, name) is not None:
            setattr(r, name, float(getattr(r, name)))
    r.mails = int(r.mails)
    if not all(isinstance(getattr(r, n), str) for n in ("key", "kind", "severity", "subject", "body")):
        raise TypeError("record text fields must be strings")
    return r


def mail_from(d: dict) -> Mail:
    m = Mail(**{k: v for k, v in d.items() if k in MAIL_FIELDS})
    m.created, m.next_try, m.attempts = float(m.created), float(m.next_try), int(m.attempts)
    if not all(isinstance(getattr(m, n), str) for n in ("key", "kind", "subject", "body", "channel",
                                                        "severity", "state")):
        raise TypeError("mail text fields must be strings")
    return m


def health_from(d: dict) -> ChannelState:
    h = ChannelState(**{k: v for k, v in d.items() if k in HEALTH_FIELDS})
    for name in ("last_ok_at", "last_failed_at", "failing_since"):
        if getattr(h, name) is not None:
            setattr(h, name, float(getattr(h, name)))
    h.failures, h.sent, h.last_error = int(h.failures), int(h.sent), str(h.last_error)
    return h


def sent_times_from(v: object) -> dict[str, list[float]]:
    if isinstance(v, list):  # before channels: the mailer's alone
        return {DEFAULT_CHANNEL: [float(t) for t in v]}
    if not isinstance(v, dict):
        raise TypeError("sent_times must be a list or an object")
    return {str(k): [float(t) for t in ts] for k, ts in v.items()}


# What the alert log calls a delivery, by channel kind ("mailed" as before channels existed).
SENT = {"email": "mailed"}
FAILED = {"email": "mail_failed"}
