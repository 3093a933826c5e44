"""Where an alert goes: the message shape and the small interface the alert outbox delivers to.

A channel takes one `Message` and either delivers it or raises; the outbox (alerts.py) owns dedup,
repeat, resolved, the hourly cap, the queue and the retries for every channel alike, and keeps a
retry state per channel. The channels: `email` (below, around the SMTP mailer of mail.py), one
Apprise channel per URL (apprise.py) and the signed webhook (webhook.py); they import this module,
never the other way round. Which of them a config asks for is built by supervisor.daemon.channels. An exception's text is shown in status
and the journal, so a channel raises only text that holds no secret.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

log = structlog.get_logger("channels")


@dataclass(frozen=True)
class Message:
    """One alert message as every channel sees it."""

    id: str            # the same for every channel and every retry of this message
    key: str           # the alert's dedup key, e.g. "sync:failing"
    kind: str          # e.g. "sync_failing", "training_finished"
    severity: str      # info | warning | critical
    state: str         # firing | reminder | resolved | event
    subject: str       # one line, without the host
    body: str
    host: str
    created: float     # when the alert queued it (Unix seconds)
    facts: dict[str, Any] = field(default_factory=dict)


class Channel(Protocol):
    name: str     # unique among the channels; the outbox keys its queue and retry state by it
    kind: str     # email | apprise | webhook
    target: str   # where it delivers, safe to show (secrets redacted)

    def send(self, msg: Message) -> None:
        """Deliver or raise (with a message that holds no secret)."""


def message_id(key: str, created: float, subject: str) -> str:
    """A stable id per message (the webhook-id a receiver deduplicates retries with)."""
    h = hashlib.sha256(f"{key}\0{created!r}\0{subject}".encode()).hexdigest()
    return f"msg_{h[:26]}"


class Mailer(Protocol):
    """What the email channel sends through (notify.mail.SmtpMailer; a test's own)."""

    def send(self, subject: str, body: str) -> None: ...


class EmailChannel:
    """The SMTP mailer behind the channel interface; the subject reads "host: subject" as always."""

    kind = "email"

    def __init__(self, mailer: Mailer, target: str = "", name: str = "email"):
        self.mailer = mailer
        self.name = name
        self.target = target or _mailer_target(mailer)

    def send(self, msg: Message) -> None:
        subject = sanitize_subject(f"{msg.host + ': ' if msg.host else ''}{msg.subject}")
        self.mailer.send(subject, msg.body)


def _mailer_target(mailer: Mailer) -> str:
    cfg = getattr(mailer, "cfg", None)
    if cfg is None or not hasattr(cfg, "smtp_host"):
        return type(mailer).__name__
    return f"smtp {cfg.smtp_host}:{cfg.smtp_port} to {', '.join(cfg.to)}"


# --- short texts for chat --------------------------------------------------------------------------

def chat_text(body: str, limit: int, host: str = "") -> str:
    """The alert text cut for a chat or push message: whole lines up to `limit` characters, and a
    pointer to the full text when something was left out."""
    text = body.strip()
    if len(text) <= limit:
        return text
    more = f"... (full text: supervisorctl alerts{' on ' + host if host else ''})"
    room = max(limit - len(more) - 1, 20)
    cut = text[:room]
    nl = cut.rfind("\n")
    if nl >= room // 2:
        cut = cut[:nl]
    return cut.rstrip() + "\n" + more


# --- secrets in error texts --------------------------------------------------------------------------

def scrub(text: str, secret_parts: list[str]) -> str:
    """Replace every secret fragment in `text` (longest first) with ***."""
    for s in sorted({p for p in secret_parts if len(p) >= 4}, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def url_secret_parts(url: str, shown: str) -> list[str]:
    """The pieces of `url` that its redacted form `shown` does not show: what must never be logged."""
    visible = set(re.split(r"[/:@?&=#,.+]+", shown))
    parts = [p for p in re.split(r"[/:@?&=#,]+", url) if p and p not in visible]
    return [*parts, url]


# --- building them from the config -----------------------------------------------------------------

_CTRL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def sanitize_subject(text: str, limit: int = 150) -> str:
    """One line, no control characters: log text can never inject a header."""
    s = _CTRL.sub(" ", text).strip()
    return s[:limit]


class ChannelSetupError(Exception):
    """A channel cannot be built from the config; the message names the key and holds no secret."""


# --- a whole-send deadline -------------------------------------------------------------------------

class SendStuck(Exception):
    """The channel did not finish a send within its whole-send deadline (a server that answers a
    byte at a time keeps urllib's or smtplib's per-read timeout from ever firing)."""


def send_deadline(ch: Channel) -> float:
    """How long one send through `ch` may take in all: twice its own timeout (connect, then the
    answer), and 20 s where it names none."""
    t = getattr(ch, "timeout", None)
    if t is None:
        t = getattr(getattr(getattr(ch, "mailer", None), "cfg", None), "timeout", None)
    try:
        return max(2.0 * float(t), 1.0) if t is not None else 20.0
    except (TypeError, ValueError):
        return 20.0


def send_within(ch: Channel, msg: Message, deadline: float, stuck: dict[str, threading.Thread]) -> None:
    """ch.send(msg), or SendStuck after `deadline` seconds. The send runs in its own thread; one
    that overruns is left to finish on its own (it holds no lock) and remembered in `stuck`, and
    the channel gets no new send until it has: at most one stuck thread per channel."""
    prev = stuck.get(ch.name)
    if prev is not None:
        if prev.is_alive():
            raise SendStuck(f"still stuck in an earlier send (no answer within {deadline:g}s)")
        del stuck[ch.name]
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            ch.send(msg)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"send-{ch.name}", daemon=True)
    t.start()
    t.join(deadline)
    if t.is_alive():
        stuck[ch.name] = t
        raise SendStuck(f"no answer within {deadline:g}s (the channel is stuck)")
    if "error" in box:
        raise box["error"]
