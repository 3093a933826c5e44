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

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import structlog

from supervisor.clock import Clock
from supervisor.config import AlertsConfig
from supervisor.interfaces import Duty, Verb
from supervisor.notify.channels import (
    Channel,
    EmailChannel,
    Message,
    message_id,
    sanitize_subject,
    send_deadline,
    send_within,
)
from supervisor.notify.outbox import (
    DEFAULT_CHANNEL,
    FAILED,
    FORGET_AFTER,
    HEALTH_FIELDS,
    MAIL_FIELDS,
    OUTBOX_MAX,
    RECORD_FIELDS,
    SENT,
    STALE_AFTER_RESTART,
    UNCAPPED_KINDS,
    AlertState,
    ChannelState,
    Mail,
    Mailer,
    Record,
    Severity,
    due_mails,
    health_from,
    mail_from,
    plan,
    queue,
    record_from,
    retry_at,
    sent_times_from,
    severity_value,
)
from supervisor.redact import redact
from supervisor.requests import bounded_int
from supervisor.statefile import StateStore, set_aside
from supervisor.status import Block
from supervisor.status.alerts import AlertsBlock, NotifyBlock

log = structlog.get_logger("alerts")

# The outbox's data and decisions, re-exported: callers know alerts.py as the face of the outbox.
__all__ = ["Alerts", "AlertState", "ChannelState", "DEFAULT_CHANNEL", "FAILED", "FORGET_AFTER", "HEALTH_FIELDS", "MAIL_FIELDS", "Mail", "Mailer", "OUTBOX_MAX", "RECORD_FIELDS", "Record", "SENT", "STALE_AFTER_RESTART", "Severity", "UNCAPPED_KINDS", "due_mails", "plan", "queue", "retry_at"]


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
                 channels: list[Channel] | None = None,
                 on_alert: Callable[[str, str, str, str], None] | None = None):
        self.cfg = cfg
        self.clock = clock
        self.hostname = hostname
        self.background = background
        if channels is None:
            channels = [EmailChannel(mailer)] if mailer is not None else []
        self.channels: dict[str, Channel] = {c.name: c for c in channels}
        # told (key, kind, severity, subject) of each alert raised or event (the [[hooks]] "alert" event)
        self.on_alert = on_alert  # (key, kind, severity, subject) of each alert raised: the daemon's hooks
        self.state = AlertState(channels=list(self.channels))
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)     # a worker delivered, failed or ended
        self._workers: dict[str, threading.Thread] = {}  # channel -> its worker, while one runs
        self._again: set[str] = set()                    # channels whose worker must go round again
        self._stuck: dict[str, threading.Thread] = {}    # channel -> a send that overran its deadline
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
                r = Record(key, kind, severity_value(severity), sanitize_subject(subject), body, True, now, now)
                self.state.records[key] = r
                self._log_event("raised", r)
                self._dirty = True
                self._tell(r)
            elif r.stale_since is not None:
                self._dirty = True
            r.last_seen, r.body, r.subject, r.stale_since = now, body, sanitize_subject(subject), None
            r.severity = severity_value(severity)

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
                r = Record(key, kind, severity_value(severity), sanitize_subject(subject), body, False, now, now)
                self.state.records[key] = r
            r.kind, r.subject, r.body, r.last_seen = kind, sanitize_subject(subject), body, now
            r.severity, r.condition, r.active, r.stale_since = severity_value(severity), False, False, None
            self._log_event("suppressed" if dup else "event", r)
            if not dup:
                self._tell(r)
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
        waiting. For the moment before a stop, so the "stopping now" mail goes out first. Each
        channel delivers on its own: the wait ends as soon as every channel has either delivered
        or failed (a stuck one fails at its whole-send deadline), never on one channel's account
        while another's mail waits."""
        with self._lock:   # a channel failing already (down, stuck) does not hold the stop up
            healthy = {n for n in self.channels if self.state.health.get(n, ChannelState()).failures == 0}
        self.tick()
        end = time.monotonic() + timeout
        with self._done:
            while set(self._workers) & healthy:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(min(left, 0.5))
        return self.outbox_size() == 0

    # --- delivery -------------------------------------------------------------------------
    def tick(self, wait: bool = False) -> None:
        """Plan due mails and hand each channel's to that channel's own worker. Never raises.
        With `background` (the daemon) it returns at once: no channel ever waits on another, nor
        the caller on any; without (tests), or with `wait`, it returns when the workers have."""
        try:
            now = self.clock.time()
            with self._lock:
                for m in plan(self.state, now, self.cfg):
                    self._dirty = True
                    if not self.channels:
                        self._not_sent(m, now)
                todo = due_mails(self.state, now, self.cfg) if self.channels else []
                self._save()
            started = [t for t in (self._start_worker(n) for n in dict.fromkeys(m.channel for m in todo)) if t]
            if wait or not self.background:
                for t in started:
                    t.join()
        except Exception:  # noqa: BLE001 - alerting must never take the daemon down
            log.exception("alerts_tick_failed")

    def _start_worker(self, name: str) -> threading.Thread | None:
        with self._lock:
            if name in self._workers:
                self._again.add(name)   # the running worker goes round once more
                return None
            t = threading.Thread(target=self._work, args=(name,), name=f"alerts-{name}", daemon=True)
            self._workers[name] = t
        t.start()
        return t

    def _work(self, name: str) -> None:
        """One channel's worker: its due mails in order, until none is left that it may try now."""
        try:
            while True:
                with self._lock:
                    self._again.discard(name)
                    now = self.clock.time()
                    mails = [m for m in due_mails(self.state, now, self.cfg) if m.channel == name]
                ok = self._deliver(name, mails, now) if mails else True
                with self._lock:
                    self._save()
                    if not (ok and name in self._again):
                        del self._workers[name]
                        self._done.notify_all()
                        return
        except Exception:  # noqa: BLE001
            log.exception("alerts_channel_failed", channel=name)
            with self._lock:
                self._workers.pop(name, None)
                self._done.notify_all()

    def _deliver(self, name: str, mails: list[Mail], now: float) -> bool:
        """Send `mails` through channel `name` in order, each within the channel's whole-send
        deadline; the first failure ends the round for this channel (its server is most likely down
        for all of them: the rest wait for their retry instead of each waiting out a timeout now)."""
        ch = self.channels.get(name)
        for m in mails:
            if ch is None:  # not configured any more (dropped on load; defensive)
                with self._lock:
                    self.state.outbox = [x for x in self.state.outbox if x is not m]
                continue
            try:
                send_within(ch, self._message(m), send_deadline(ch), self._stuck)
            except Exception as e:  # noqa: BLE001 - any delivery failure is retried
                with self._lock:
                    m.attempts += 1
                    m.last_error = sanitize_subject(redact(f"{type(e).__name__}: {e}"), 300)
                    m.next_try = retry_at(now, m.attempts, self.cfg)
                    h = self.state.health.setdefault(name, ChannelState())
                    if h.failures == 0:
                        h.failing_since = now
                    h.failures += 1
                    h.last_failed_at, h.last_error = now, m.last_error
                    self._dirty = True
                    self._append_log({"at": now, "what": FAILED.get(ch.kind, "send_failed"), "channel": name,
                                      "key": m.key, "kind": m.kind, "subject": m.subject, "error": m.last_error,
                                      "attempts": m.attempts, "next_try": m.next_try})
                    self._done.notify_all()
                log.warning("alert_" + FAILED.get(ch.kind, "send_failed"), channel=name, key=m.key,
                            error=m.last_error, attempts=m.attempts)
                return False
            sent_at = self.clock.time()
            with self._lock:
                self.state.outbox = [x for x in self.state.outbox if x is not m]
                self.state.sent_times.setdefault(name, []).append(sent_at)
                h = self.state.health.setdefault(name, ChannelState())
                h.failures, h.last_ok_at, h.sent, h.failing_since = 0, sent_at, h.sent + 1, None
                self._dirty = True
                self._append_log({"at": sent_at, "what": SENT.get(ch.kind, "sent"), "channel": name,
                                  "key": m.key, "kind": m.kind, "subject": m.subject, "attempts": m.attempts + 1})
                self._done.notify_all()
            log.info("alert_" + SENT.get(ch.kind, "sent"), channel=name, key=m.key, kind=m.kind, subject=m.subject)
        return True

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

    def _tell(self, r: Record) -> None:
        if self.on_alert is not None:
            try:
                self.on_alert(r.key, r.kind, r.severity, r.subject)
            except Exception:  # noqa: BLE001 - a listener never holds up an alert
                log.exception("alert_listener_failed")

    def _kick(self) -> None:
        if not self.channels:
            self.tick()  # no I/O beyond the log file: cheap enough to do in the caller
        elif self.background:
            self.tick()  # plans and hands over to the channels' workers: returns at once

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
                records = {str(k): record_from(v) for k, v in data.get("records", {}).items()}
                outbox = [mail_from(m) for m in data.get("outbox", [])]
                sent = sent_times_from(data.get("sent_times", {}))
                health = {str(k): health_from(v) for k, v in data.get("channels", {}).items()}
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

    # --- what the daemon lists -------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("alerts", 5.0, self.tick),)

    def status_blocks(self) -> tuple[Block, ...]:
        return AlertsBlock.of({"alerts": self.active()}), NotifyBlock.of({"channels": self.channel_status()})

    def verbs(self) -> dict[str, Verb]:
        return {"alerts": lambda a: {"active": self.active(), "recent": self.recent(bounded_int(a.get("n", 50), "n", 1, 1000))}}
