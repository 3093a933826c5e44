"""The daemon's wiring of the notify wing: which channels a config asks for, built once.

Kept out of supervisor.notify.channels (the base every channel imports) so that the base never
imports the concrete channels built on it: the arrows go wiring -> channels, never back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import structlog

from supervisor.config import Config
from supervisor.notify.channels import Channel, ChannelSetupError, EmailChannel

log = structlog.get_logger("channels")


def read_url_lines(path: str) -> list[str]:
    """Apprise URLs from `notify.urls_file`: one per line; blank lines and # comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ChannelSetupError(f"notify.urls_file {path}: cannot read ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:
        raise ChannelSetupError(f"notify.urls_file {path}: not UTF-8 text") from None
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def build_channels(cfg: Config, *, hostname: str = "", facts: Callable[[str], dict] | None = None,
                   mailer: Any = None) -> tuple[list[Channel], list[str]]:
    """Every configured channel, and a problem line for each that cannot be built (the daemon runs
    on with the others and shows the problem in status)."""
    out: list[Channel] = []
    problems: list[str] = []
    if mailer is None and cfg.email is not None:
        from supervisor.notify.mail import build_mailer

        mailer = build_mailer(cfg)
    if mailer is not None:
        out.append(EmailChannel(mailer))
    urls = [("notify.urls", i, u) for i, u in enumerate(cfg.notify.urls)]
    if cfg.notify.urls_file:
        try:
            urls += [("notify.urls_file", i, u) for i, u in enumerate(read_url_lines(cfg.notify.urls_file))]
        except ChannelSetupError as e:
            problems.append(str(e))
    if urls:
        from supervisor.notify.apprise import AppriseChannel

        taken: set[str] = set()
        for where, i, url in urls:
            try:
                ch = AppriseChannel(url, timeout=cfg.notify.timeout, chat_max_chars=cfg.notify.chat_max_chars)
            except ChannelSetupError as e:
                problems.append(f"{where}[{i}]: {e}")
                continue
            if ch.name in taken:
                ch.name = f"{ch.name}-{hashlib.sha256(url.encode()).hexdigest()[:6]}"
            taken.add(ch.name)
            out.append(ch)
    if cfg.notify.webhook_url:
        from supervisor.notify.webhook import WebhookChannel

        out.append(WebhookChannel(cfg.notify.webhook_url, cfg.notify.webhook_secret_file,
                                  timeout=cfg.notify.timeout, facts=facts))
    for p in problems:
        log.error("notify_channel_problem", problem=p)
    return out, problems
