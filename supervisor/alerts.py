"""The one way any part of the daemon tells the owner something.

Two kinds of alert:
- a *condition* (`fire` while it holds, `resolve` when it clears): the first mail waits
  `alerts.first_delay` so a blip sends nothing, a reminder goes out only after `repeat_interval`,
  and one "resolved" mail follows when it clears;
- an *event* (`event`): something that happened (an OOM line, training finished, the idle warning).
  Sent at once; the same dedup key is not mailed again within `repeat_interval`.

Deciding what to send is the pure function `plan()` over the records and `now`; delivery is done
by a Mailer outside the lock and reports back. A failed delivery stays in the outbox and is retried;
nothing blocks the caller. Every alert, sent or not, lands in `alerts.jsonl` in state_dir and in the
journal, so a machine without SMTP still shows them in `supervisorctl alerts`.
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

import structlog

from .clock import Clock
from .config import AlertsConfig

log = structlog.get_logger("alerts")


class Severity(str, Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


# Lifecycle notices are mailed even when the hourly cap is reached: the owner must hear that the
# machine is about to stop (or did), and there are at most a handful of them per idle cycle.
UNCAPPED_KINDS = frozenset({"idle_warning", "stop_cancelled", "stopping", "training_finished",
                            "training_failed", "stop_failed"})


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


@dataclass
class AlertState:
    records: dict[str, Record] = field(default_factory=dict)
    outbox: list[Mail] = field(default_factory=list)
    sent_times: list[float] = field(default_factory=list)  # for the hourly cap


def plan(state: AlertState, now: float, cfg: AlertsConfig) -> list[Mail]:
    """Move due records into mails; pure except for mutating `state`. Returns the new mails."""
    new: list[Mail] = []
    for r in state.records.values():
        if r.resolve_pending:
            r.resolve_pending = False
            if r.mails > 0:
                new.append(Mail(r.key, r.kind, f"RESOLVED: {r.subject}",
                                f"{r.body}\n\nResolved at {_ts(now)}.", now))
            continue
        if not r.active or not r.condition:
            continue
        if r.last_mailed is None:
            if now - r.first_seen >= cfg.first_delay:
                new.append(Mail(r.key, r.kind, r.subject, r.body, now))
                r.last_mailed = now
                r.mails += 1
        elif now - r.last_mailed >= cfg.repeat_interval:
            new.append(Mail(r.key, r.kind, f"STILL: {r.subject}", r.body, now))
            r.last_mailed = now
            r.mails += 1
    for m in new:
        m.uncapped = m.kind in UNCAPPED_KINDS
    state.outbox.extend(new)
    return new


def due_mails(state: AlertState, now: float, cfg: AlertsConfig) -> list[Mail]:
    """The mails to try now, respecting retry times and the hourly cap."""
    state.sent_times = [t for t in state.sent_times if now - t < 3600]
    budget = cfg.max_per_hour - len(state.sent_times)
    out = []
    for m in state.outbox:
        if m.next_try > now:
            continue
        if m.uncapped:
            out.append(m)
        elif budget > 0:
            out.append(m)
            budget -= 1
    return out


_CTRL = re.compile(r"[\x00-\x1f\x7f]+")


def sanitize_subject(text: str, limit: int = 150) -> str:
    """One line, no control characters: log text can never inject a header."""
    s = _CTRL.sub(" ", text).strip()
    return s[:limit]


def _ts(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Mailer(Protocol):
    def send(self, subject: str, body: str) -> None:
        """Deliver or raise."""


class Alerts:
    """Thread-safe front door. `tick()` (scheduled every few seconds) plans and delivers."""

    MAX_LOG = 200

    def __init__(self, cfg: AlertsConfig, clock: Clock, state_dir: str | Path | None,
                 mailer: Mailer | None = None, hostname: str = ""):
        self.cfg = cfg
        self.clock = clock
        self.mailer = mailer
        self.hostname = hostname
        self.state = AlertState()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._dir = Path(state_dir) if state_dir else None
        self._recent: deque[dict] = deque(maxlen=self.MAX_LOG)
        self._load()

    # --- what the rest of the daemon calls -------------------------------------------------
    def fire(self, key: str, kind: str, severity: Severity | str, subject: str, body: str) -> None:
        """A condition holds (call on every check while it does)."""
        now = self.clock.time()
        with self._lock:
            r = self.state.records.get(key)
            if r is None or not r.active:
                r = Record(key, kind, Severity(severity).value, sanitize_subject(subject), body, True, now, now)
                self.state.records[key] = r
                self._log_event("raised", r)
            else:
                r.last_seen = now
                r.body = body
                r.subject = sanitize_subject(subject)

    def resolve(self, key: str) -> None:
        now = self.clock.time()
        with self._lock:
            r = self.state.records.get(key)
            if r is None or not r.active:
                return
            r.active = False
            r.resolved_at = now
            r.resolve_pending = r.condition
            self._log_event("resolved", r)
        self.tick()

    def event(self, key: str, kind: str, severity: Severity | str, subject: str, body: str) -> bool:
        """Something happened. Mailed at once unless the same key was mailed within repeat_interval.
        Returns whether a mail was queued."""
        now = self.clock.time()
        with self._lock:
            r = self.state.records.get(key)
            dup = r is not None and r.last_mailed is not None and now - r.last_mailed < self.cfg.repeat_interval
            if r is None:
                r = Record(key, kind, Severity(severity).value, sanitize_subject(subject), body, False, now, now)
                self.state.records[key] = r
            r.kind, r.subject, r.body, r.last_seen = kind, sanitize_subject(subject), body, now
            r.active = False
            self._log_event("suppressed" if dup else "event", r)
            if not dup:
                m = Mail(key, kind, r.subject, body, now, uncapped=kind in UNCAPPED_KINDS)
                self.state.outbox.append(m)
                r.last_mailed = now
                r.mails += 1
            self._save()
        if not dup:
            self.tick()
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

    # --- delivery -------------------------------------------------------------------------
    def tick(self) -> None:
        """Plan due mails and try to deliver them. Never raises; SMTP runs outside the state lock
        and only one tick delivers at a time, so a slow server never blocks `fire`."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            now = self.clock.time()
            with self._lock:
                plan(self.state, now, self.cfg)
                if self.mailer is None:
                    for m in self.state.outbox:
                        self._append_log({"at": now, "what": "not_mailed", "key": m.key, "kind": m.kind,
                                          "subject": m.subject, "reason": "no [email] configured"})
                    self.state.outbox.clear()
                    self._save()
                    return
                todo = due_mails(self.state, now, self.cfg)
                self._save()
            for m in todo:
                subject = sanitize_subject(f"{self.hostname + ': ' if self.hostname else ''}{m.subject}")
                try:
                    self.mailer.send(subject, m.body)
                except Exception as e:  # noqa: BLE001 - any delivery failure is retried
                    with self._lock:
                        m.attempts += 1
                        m.last_error = f"{type(e).__name__}: {e}"[:300]
                        m.next_try = now + min(self.cfg.retry_interval * (2 ** min(m.attempts - 1, 5)), 3600)
                        self._append_log({"at": now, "what": "mail_failed", "key": m.key, "kind": m.kind,
                                          "subject": m.subject, "error": m.last_error,
                                          "attempts": m.attempts})
                    log.warning("alert_mail_failed", key=m.key, error=m.last_error, attempts=m.attempts)
                    continue
                with self._lock:
                    if m in self.state.outbox:
                        self.state.outbox.remove(m)
                    self.state.sent_times.append(now)
                    self._append_log({"at": now, "what": "mailed", "key": m.key, "kind": m.kind,
                                      "subject": m.subject})
                log.info("alert_mailed", key=m.key, kind=m.kind, subject=m.subject)
            with self._lock:
                self._save()
        except Exception:  # noqa: BLE001 - alerting must never take the daemon down
            log.exception("alerts_tick_failed")
        finally:
            self._send_lock.release()

    # --- persistence ----------------------------------------------------------------------
    def _public(self, r: Record) -> dict:
        return {"key": r.key, "kind": r.kind, "severity": r.severity, "subject": r.subject,
                "since": r.first_seen, "mails": r.mails}

    def _log_event(self, what: str, r: Record) -> None:
        entry = {"at": self.clock.time(), "what": what, "key": r.key, "kind": r.kind,
                 "severity": r.severity, "subject": r.subject, "body": r.body[:2000]}
        self._append_log(entry)
        lvl = "warning" if r.severity != "info" else "info"
        getattr(log, lvl)("alert", what=what, key=r.key, kind=r.kind, subject=r.subject)

    def _append_log(self, entry: dict) -> None:
        self._recent.append(entry)
        if self._dir is None:
            return
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            p = self._dir / "alerts.jsonl"
            with open(p, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
            if p.stat().st_size > 4 * 1024 * 1024:
                p.replace(p.with_suffix(".jsonl.1"))
        except OSError as e:
            log.error("alert_log_write_failed", error=str(e))

    def _save(self) -> None:
        if self._dir is None:
            return
        from .statefile import StateStore

        data = {"records": {k: asdict(v) for k, v in self.state.records.items()},
                "outbox": [asdict(m) for m in self.state.outbox],
                "sent_times": self.state.sent_times}
        try:
            StateStore(self._dir).save("alerts", data)
        except OSError as e:
            log.error("alert_state_save_failed", error=str(e))

    def _load(self) -> None:
        if self._dir is None:
            return
        from .statefile import StateStore

        store = StateStore(self._dir)
        data = store.load("alerts", None)
        try:
            if data:
                self.state.records = {k: Record(**v) for k, v in data.get("records", {}).items()}
                self.state.outbox = [Mail(**m) for m in data.get("outbox", [])]
                self.state.sent_times = [float(t) for t in data.get("sent_times", [])]
        except (TypeError, ValueError, AttributeError) as e:
            log.error("alert_state_unusable", error=str(e))
            self.state = AlertState()
        p = self._dir / "alerts.jsonl"
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                for line in deque(f, maxlen=self.MAX_LOG):
                    try:
                        self._recent.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        except OSError:
            pass
