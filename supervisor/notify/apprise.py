"""One Apprise URL as an alert channel (Slack, Discord, Telegram, ntfy, json:// and ~100 more).

Apprise reports a failed delivery as `False` and says why only in its log, so each send captures
that log and raises its last warning with every part of the URL that could be a token scrubbed.
Apprise's own log is kept out of the journal for the same reason (a plugin may print its URL).
Sends go one at a time: the capture hooks Apprise's one global logger.
"""

from __future__ import annotations

import logging
import threading

from supervisor.config import redact_url
from supervisor.notify.channels import ChannelSetupError, Message, chat_text, scrub, url_secret_parts

_SEND_LOCK = threading.Lock()


class AppriseError(Exception):
    """Apprise did not deliver; the text holds no part of the URL's secrets."""


def _apprise():
    import apprise

    logging.getLogger("apprise").propagate = False  # its messages may carry the URL; ours are scrubbed
    return apprise


class AppriseChannel:
    kind = "apprise"

    def __init__(self, url: str, timeout: float = 10.0, chat_max_chars: int = 700):
        apprise = _apprise()
        self.url = url
        self.target = redact_url(url)
        scheme = url.split("://", 1)[0].lower()
        self.name = scheme
        self.chat_max_chars = chat_max_chars
        self._secrets = url_secret_parts(url, self.target)
        # "memory": Apprise keeps no cache files under the daemon's home directory.
        asset = apprise.AppriseAsset(storage_mode="memory")
        plugin = apprise.Apprise.instantiate(url, asset=asset, suppress_exceptions=True)
        if plugin is None:
            raise ChannelSetupError(f"Apprise does not understand this {scheme}:// URL ({self.target}): "
                                    "unknown service or a missing part; see the Apprise wiki for its form")
        plugin.socket_connect_timeout = min(timeout, 30.0)
        plugin.socket_read_timeout = timeout
        # Apprise spaces requests to one service 5.5 s apart by default; our hourly cap already keeps
        # the rate low, and a burst before a stop must not wait that long per message.
        plugin.request_rate_per_sec = min(float(plugin.request_rate_per_sec or 0), 1.0)
        self._plugin = plugin

    def send(self, msg: Message) -> None:
        apprise = _apprise()
        title = f"{msg.host}: {msg.subject}" if msg.host else msg.subject
        body = chat_text(msg.body, self.chat_max_chars, msg.host) or msg.subject
        with _SEND_LOCK, apprise.LogCapture(level=logging.WARNING, fmt="%(message)s") as captured:
            try:
                ok = self._plugin.notify(body=body, title=title, notify_type=_notify_type(msg))
            except Exception as e:  # noqa: BLE001 - a plugin bug must read as a failed delivery
                raise AppriseError(scrub(f"{type(e).__name__}: {e}", self._secrets)[:300]) from None
            said = captured.getvalue()
        if not ok:
            lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
            why = lines[-1] if lines else "the service did not accept the message"
            raise AppriseError(scrub(why, self._secrets)[:300])


def _notify_type(msg: Message) -> str:
    if msg.state == "resolved":
        return "success"
    return {"critical": "failure", "warning": "warning"}.get(msg.severity, "info")


def check_urls(urls: list[str]) -> list[str]:
    """A problem line for each URL Apprise cannot use (for `supervisorctl check-config`)."""
    problems = []
    for i, u in enumerate(urls):
        try:
            AppriseChannel(u)
        except ChannelSetupError as e:
            problems.append(f"notify.urls[{i}]: {e}")
    return problems
