"""The one way any part of the daemon tells the owner something.

Two kinds of alert:
- a *condition* (`fire` while it holds, `resolve` when it clears): the first mail waits
  `alerts.first_delay` so a blip sends nothing, a reminder goes out only after `repeat_interval`,
  and one "resolved" mail follows when it clears;
- an *event* (`event`): something that happened (an OOM line, training finished, the idle warning).
  Sent at once; the same dedup key is not mailed again within `repeat_interval`.

Deciding what to send is the pure function `plan()` over the records and `now`; each message is
queued once per channel (email, each Apprise URL, the webhook: channels.py) and delivered outside
the lock. Dedup, repeat, resolved and the queue are shared; the hourly cap, the retries and the
channel's health are per channel, so a dead chat service neither blocks the mail nor eats its cap.
A failed delivery stays in the outbox and is retried; nothing blocks the caller. Every alert, sent
or not, lands in `alerts.jsonl` in state_dir and in the journal, so a machine without any channel
still shows them in `supervisorctl alerts`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import structlog

from .channels import Channel, EmailChannel, Message, message_id
from .clock import Clock
from .config import AlertsConfig
from .redact import redact
from .statefile import StateStore, set_aside
from .timefmt import when

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
                            "preemption", "preemption_outcome", "preempted_previous"})


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


_CTRL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def sanitize_subject(text: str, limit: int = 150) -> str:
    """One line, no control characters: log text can never inject a header."""
    s = _CTRL.sub(" ", text).strip()
    return s[:limit]


class Mailer(Protocol):
    def send(self, subject: str, body: str) -> None:
        """Deliver or raise."""


def _severity(value: Severity | str) -> str:
    try:
        return Severity(value).value
    except ValueError:
        log.error("alert_bad_severity", severity=str(value))
        return Severity.WARNING.value


_RECORD_FIELDS = {f.name for f in fields(Record)}
_MAIL_FIELDS = {f.name for f in fields(Mail)}
_HEALTH_FIELDS = {f.name for f in fields(ChannelState)}


def _record_from(d: dict) -> Record:
    r = Record(**{k: v for k, v in d.items() if k in _RECORD_FIELDS})
    for name in ("first_seen", "last_seen"):
        setattr(r, name, float(getattr(r, name)))
    for name in ("last_mailed", "resolved_at", "stale_since"):
        if getattr(r, name) is not None:
            setattr(r, name, float(getattr(r, name)))
    r.mails = int(r.mails)
    if not all(isinstance(getattr(r, n), str) for n in ("key", "kind", "severity", "subject", "body")):
        raise TypeError("record text fields must be strings")
    return r


def _mail_from(d: dict) -> Mail:
    m = Mail(**{k: v for k, v in d.items() if k in _MAIL_FIELDS})
    m.created, m.next_try, m.attempts = float(m.created), float(m.next_try), int(m.attempts)
    if not all(isinstance(getattr(m, n), str) for n in ("key", "kind", "subject", "body", "channel",
                                                        "severity", "state")):
        raise TypeError("mail text fields must be strings")
    return m


def _health_from(d: dict) -> ChannelState:
    h = ChannelState(**{k: v for k, v in d.items() if k in _HEALTH_FIELDS})
    for name in ("last_ok_at", "last_failed_at", "failing_since"):
        if getattr(h, name) is not None:
            setattr(h, name, float(getattr(h, name)))
    h.failures, h.sent, h.last_error = int(h.failures), int(h.sent), str(h.last_error)
    return h


def _sent_times_from(v: object) -> dict[str, list[float]]:
    if isinstance(v, list):  # before channels: the mailer's alone
        return {DEFAULT_CHANNEL: [float(t) for t in v]}
    if not isinstance(v, dict):
        raise TypeError("sent_times must be a list or an object")
    return {str(k): [float(t) for t in ts] for k, ts in v.items()}


# What the alert log calls a delivery, by channel kind ("mailed" as before channels existed).
_SENT = {"email": "mailed"}
_FAILED = {"email": "mail_failed"}


class Alerts:
    """Thread-safe front door.

    `fire`/`resolve`/`event` only record and return at once; delivery happens in `tick()`, which
    the daemon schedules every few seconds, and (with `background`) in a short-lived thread that
    an event or a resolve starts so the mail does not wait for the next tick. Each channel delivers
    in its own thread, so a slow or dead server never blocks the caller nor the other channels.
    `flush(timeout)` is for the last words before a stop: it delivers what is due and waits at
    most `timeout`. `mailer` alone means the one email channel; `channels` lists them all.
    """

    MAX_LOG = 200

    def __init__(self, cfg: AlertsConfig, clock: Clock, state_dir: str | Path | None,
                 mailer: Mailer | None = None, hostname: str = "", *, background: bool = True,
                 channels: list[Channel] | None = None):
        self.cfg = cfg
        self.clock = clock
        self.hostname = hostname
        self.background = background
        if channels is None:
            channels = [EmailChannel(mailer)] if mailer is not None else []
        self.channels: dict[str, Channel] = {c.name: c for c in channels}
        self.state = AlertState(channels=list(self.channels))
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._rekick = threading.Event()  # a mail was queued while a delivery was under way
        self._dirty = False
        self._dir = Path(state_dir) if state_dir else None
        self._recent: deque[dict] = deque(maxlen=self.MAX_LOG)
        self._load()

    # --- what the rest of the daemon calls -------------------------------------------------
    def fire(self, key: str, kind: str, severity: Severity | str, subject: str, body: str) -> None:
        """A condition holds (call on every check while it does)."""
        subject, body = redact(subject), redact(body)  # a stop command or a run command may carry keys
        now = self.clock.time()
        with self._lock:
            r = self.state.records.get(key)
            if r is not None and r.condition and not r.active and r.resolve_pending:
                # Back before the resolved mail went out: the same alert goes on, no new first mail.
                r.active, r.resolve_pending, r.resolved_at = True, False, None
                self._log_event("reraised", r)
                self._dirty = True
            elif r is None or not r.active or not r.condition:
                r = Record(key, kind, _severity(severity), sanitize_subject(subject), body, True, now, now)
                self.state.records[key] = r
                self._log_event("raised", r)
                self._dirty = True
            elif r.stale_since is not None:
                self._dirty = True
            r.last_seen, r.body, r.subject, r.stale_since = now, body, sanitize_subject(subject), None
            r.severity = _severity(severity)

    def resolve(self, key: str) -> None:
        """The condition behind `key` cleared; a "resolved" mail follows if it had been mailed."""
        now = self.clock.time()
        with self._lock:
            r = self.state.records.get(key)
            if r is None or not r.active:
                return
            r.active = False
            r.resolved_at = now
            r.last_seen = now
            r.resolve_pending = r.condition
            self._dirty = True
            self._log_event("resolved", r)
        self._kick()

    def event(self, key: str, kind: str, severity: Severity | str, subject: str, body: str) -> bool:
        """Something happened. Mailed at once unless the same key was mailed within repeat_interval
        (lifecycle notices that must always reach the owner need a key per occurrence).
        Returns whether a mail was queued."""
        subject, body = redact(subject), redact(body)
        now = self.clock.time()
        with self._lock:
            r = self.state.records.get(key)
            dup = r is not None and r.last_mailed is not None and 0 <= now - r.last_mailed < self.cfg.repeat_interval
            if r is None:
                r = Record(key, kind, _severity(severity), sanitize_subject(subject), body, False, now, now)
                self.state.records[key] = r
            r.kind, r.subject, r.body, r.last_seen = kind, sanitize_subject(subject), body, now
            r.severity, r.condition, r.active, r.stale_since = _severity(severity), False, False, None
            self._log_event("suppressed" if dup else "event", r)
            if not dup:
                self._queue(Mail(key, kind, r.subject, body, now, replaceable=True, severity=r.severity))
                r.last_mailed = now
                r.mails += 1
            self._dirty = True
            self._save()
        self._kick()
        return not dup

    def active(self) -> list[dict]:
        with self._lock:
            return [self._public(r) for r in self.state.records.values() if r.active]

    def recent(self, n: int = 50) -> list[dict]:
        with self._lock:
            return list(self._recent)[-n:]

    def outbox_size(self) -> int:
        with self._lock:
            return len(self.state.outbox)

    def flush(self, timeout: float = 30.0) -> bool:
        """Deliver what is due now, waiting at most `timeout` seconds; True when nothing is left
        waiting. For the moment before a stop, so the "stopping now" mail goes out first."""
        t = threading.Thread(target=self.tick, kwargs={"wait": True}, name="alerts-flush", daemon=True)
        t.start()
        t.join(timeout)
        return not t.is_alive() and self.outbox_size() == 0

    # --- delivery -------------------------------------------------------------------------
    def tick(self, wait: bool = False) -> None:
        """Plan due mails and try to deliver them. Never raises. Delivery runs outside the state
        lock, one thread per channel, and only one tick delivers at a time (another one returns at
        once unless `wait`)."""
        if not self._send_lock.acquire(blocking=wait):
            return  # the running tick sees _rekick and goes round again for what was just queued
        failed = False
        try:
            self._rekick.clear()
            now = self.clock.time()
            with self._lock:
                for m in plan(self.state, now, self.cfg):
                    self._dirty = True
                    if not self.channels:
                        self._not_sent(m, now)
                todo = due_mails(self.state, now, self.cfg) if self.channels else []
                self._save()
            by_channel: dict[str, list[Mail]] = {}
            for m in todo:
                by_channel.setdefault(m.channel, []).append(m)
            results: dict[str, bool] = {}
            threads = [threading.Thread(target=self._deliver, args=(name, mails, now, results),
                                        name=f"alerts-{name}", daemon=True)
                       for name, mails in by_channel.items()]
            if len(threads) == 1:
                threads[0].run()  # the common case: no thread to start
            else:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            failed = not all(results.values())
            with self._lock:
                self._save()
        except Exception:  # noqa: BLE001 - alerting must never take the daemon down
            log.exception("alerts_tick_failed")
        finally:
            self._send_lock.release()
        if self._rekick.is_set() and not failed and self.background:
            self._kick()

    def _deliver(self, name: str, mails: list[Mail], now: float, results: dict[str, bool]) -> None:
        """Send `mails` through channel `name` in order; the first failure ends the round for this
        channel (its server is most likely down for all of them: the rest wait for the next tick
        instead of each waiting out its own timeout now)."""
        results[name] = True
        ch = self.channels.get(name)
        for m in mails:
            if ch is None:  # not configured any more (dropped on load; defensive)
                with self._lock:
                    self.state.outbox = [x for x in self.state.outbox if x is not m]
                continue
            try:
                ch.send(self._message(m))
            except Exception as e:  # noqa: BLE001 - any delivery failure is retried
                with self._lock:
                    m.attempts += 1
                    m.last_error = sanitize_subject(f"{type(e).__name__}: {e}", 300)
                    m.next_try = retry_at(now, m.attempts, self.cfg)
                    h = self.state.health.setdefault(name, ChannelState())
                    if h.failures == 0:
                        h.failing_since = now
                    h.failures += 1
                    h.last_failed_at, h.last_error = now, m.last_error
                    self._dirty = True
                    self._append_log({"at": now, "what": _FAILED.get(ch.kind, "send_failed"), "channel": name,
                                      "key": m.key, "kind": m.kind, "subject": m.subject, "error": m.last_error,
                                      "attempts": m.attempts, "next_try": m.next_try})
                log.warning("alert_" + _FAILED.get(ch.kind, "send_failed"), channel=name, key=m.key,
                            error=m.last_error, attempts=m.attempts)
                results[name] = False
                return
            sent_at = self.clock.time()
            with self._lock:
                self.state.outbox = [x for x in self.state.outbox if x is not m]
                self.state.sent_times.setdefault(name, []).append(sent_at)
                h = self.state.health.setdefault(name, ChannelState())
                h.failures, h.last_ok_at, h.sent, h.failing_since = 0, sent_at, h.sent + 1, None
                self._dirty = True
                self._append_log({"at": sent_at, "what": _SENT.get(ch.kind, "sent"), "channel": name,
                                  "key": m.key, "kind": m.kind, "subject": m.subject, "attempts": m.attempts + 1})
            log.info("alert_" + _SENT.get(ch.kind, "sent"), channel=name, key=m.key, kind=m.kind, subject=m.subject)

    def _message(self, m: Mail) -> Message:
        return Message(id=message_id(m.key, m.created, m.subject), key=m.key, kind=m.kind, severity=m.severity,
                       state=m.state, subject=m.subject, body=m.body, host=self.hostname, created=m.created)

    def channel_status(self) -> list[dict]:
        """Each channel's health for `status --json` (`notify.channels`)."""
        with self._lock:
            out = []
            for name, ch in self.channels.items():
                h = self.state.health.get(name, ChannelState())
                queued = [m for m in self.state.outbox if m.channel == name]
                retry = [m.next_try for m in queued if m.attempts > 0]
                state = "failing" if h.failures else ("ok" if h.last_ok_at is not None else "unused")
                out.append({"name": name, "kind": ch.kind, "target": ch.target, "state": state,
                            "queued": len(queued), "sent": h.sent, "failures": h.failures,
                            "last_ok_at": h.last_ok_at, "last_failed_at": h.last_failed_at,
                            "failing_since": h.failing_since,
                            "last_error": h.last_error or None, "next_try": min(retry) if retry else None})
            return out

    def _kick(self) -> None:
        if not self.channels:
            self.tick()  # no I/O beyond the log file: cheap enough to do in the caller
        elif self.background:
            self._rekick.set()
            threading.Thread(target=self.tick, name="alerts-deliver", daemon=True).start()

    def _not_sent(self, m: Mail, now: float) -> None:
        self._append_log({"at": now, "what": "not_mailed", "key": m.key, "kind": m.kind,
                          "subject": m.subject, "reason": "no [email] or [notify] channel configured"})

    def _queue(self, m: Mail) -> None:
        if not self.channels:
            self._not_sent(m, self.clock.time())
            return
        for d in queue(self.state, m):
            self._log_mail("superseded" if d.key == m.key else "dropped", d)
        self._log_mail("queued", m)

    # --- persistence ----------------------------------------------------------------------
    def _public(self, r: Record) -> dict:
        return {"key": r.key, "kind": r.kind, "severity": r.severity, "subject": r.subject,
                "since": r.first_seen, "mails": r.mails, "last_mailed": r.last_mailed}

    def _log_event(self, what: str, r: Record) -> None:
        entry = {"at": self.clock.time(), "what": what, "key": r.key, "kind": r.kind,
                 "severity": r.severity, "subject": r.subject, "body": r.body[:2000]}
        self._append_log(entry)
        lvl = "warning" if r.severity != "info" else "info"
        getattr(log, lvl)("alert", what=what, key=r.key, kind=r.kind, subject=r.subject)

    def _log_mail(self, what: str, m: Mail) -> None:
        if what == "queued":
            return  # the raise/event entry already says it; queued mails show up as mailed or failed
        self._append_log({"at": self.clock.time(), "what": what, "channel": m.channel, "key": m.key,
                          "kind": m.kind, "subject": m.subject})
        log.warning("alert_mail_" + what, channel=m.channel, key=m.key, subject=m.subject)

    def _append_log(self, entry: dict) -> None:
        self._recent.append(entry)
        if self._dir is None:
            return
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            p = self._dir / "alerts.jsonl"
            # 0600 like every state file: alert texts can name paths and hosts, and after a rotation
            # a plain open() would create the new file with the umask's 0644
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            with open(fd, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
            if p.stat().st_size > 4 * 1024 * 1024:
                p.replace(p.with_suffix(".jsonl.1"))
        except OSError as e:
            log.error("alert_log_write_failed", error=str(e))

    def _save(self) -> None:
        """Persist when something changed (not on every tick: no fsync every few seconds)."""
        if self._dir is None or not self._dirty:
            return
        data = {"records": {k: asdict(v) for k, v in self.state.records.items()},
                "outbox": [asdict(m) for m in self.state.outbox],
                "sent_times": self.state.sent_times,
                "channels": {k: asdict(v) for k, v in self.state.health.items()}}
        try:
            StateStore(self._dir).save("alerts", data)
            self._dirty = False
        except OSError as e:
            log.error("alert_state_save_failed", error=str(e))

    def _load(self) -> None:
        if self._dir is None:
            return
        store = StateStore(self._dir)
        data = store.load("alerts", None)
        self.problems.extend(store.problems)
        try:
            if data is not None:
                if not isinstance(data, dict):
                    raise TypeError(f"expected an object, got {type(data).__name__}")
                records = {str(k): _record_from(v) for k, v in data.get("records", {}).items()}
                outbox = [_mail_from(m) for m in data.get("outbox", [])]
                sent = _sent_times_from(data.get("sent_times", {}))
                health = {str(k): _health_from(v) for k, v in data.get("channels", {}).items()}
                self.state = AlertState(records, outbox, sent, list(self.channels), health)
        except (TypeError, ValueError, AttributeError) as e:
            self._set_aside(store, f"unusable alert state ({e})")
            self.state = AlertState(channels=list(self.channels))
        gone = [m for m in self.state.outbox if m.channel not in self.channels]
        if gone:
            self.state.outbox = [m for m in self.state.outbox if m.channel in self.channels]
            self.state.health = {k: v for k, v in self.state.health.items() if k in self.channels}
            for m in gone:
                self._append_log({"at": self.clock.time(), "what": "not_mailed", "channel": m.channel,
                                  "key": m.key, "kind": m.kind, "subject": m.subject,
                                  "reason": f"channel {m.channel} is no longer configured"})
            self._dirty = True
        now = self.clock.time()
        for r in self.state.records.values():
            if r.active and r.condition:
                r.stale_since = now
        p = self._dir / "alerts.jsonl"
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                for line in deque(f, maxlen=self.MAX_LOG):
                    try:
                        entry = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(entry, dict):
                        self._recent.append(entry)
        except OSError:
            pass

    def _set_aside(self, store: StateStore, why: str) -> None:
        p = store.path("alerts")
        aside = set_aside(p)
        msg = f"{p}: {why}; set aside as {aside.name}, starting from no alerts"
        self.problems.append(msg)
        log.error("state_file_problem", problem=msg)
