"""The daemon's wiring of the notify wing: which channels a config asks for, built once.

Kept out of supervisor.notify.channels (the base every channel imports) so that the base never
imports the concrete channels built on it: the arrows go wiring -> channels, never back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import structlog

from supervisor.config import Config
from supervisor.notify.channels import Channel, ChannelSetupError, EmailChannel, Mailer

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
                   mailer: Mailer | None = None) -> tuple[list[Channel], list[str]]:
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


def register_secrets(cfg: Config, env: dict[str, str] | None = None) -> int:
    """Read every secret the config points at, once, and register it with the redactor (see
    supervisor.redact): it is then masked in mails, chat, webhooks, status, the journal and the
    logs wherever it appears. Returns how many values were registered. Unreadable files are skipped
    here; the part that needs the secret reports them."""
    import os

    from supervisor import redact

    env = dict(os.environ) if env is None else env
    values: list[str] = []

    def read(path: str) -> None:
        if not path:
            return
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                values.extend(ln.strip() for ln in f.read().splitlines() if ln.strip())
        except (OSError, UnicodeDecodeError):
            pass

    if cfg.email is not None:
        read(cfg.email.password_file)
    read(cfg.notify.webhook_secret_file)
    read(cfg.idle.jupyter_token_file)
    read(cfg.sync.hf_token_file)
    read(cfg.stop.api_key_file)   # a provider's account key (Lambda)
    read(cfg.cluster.key_file)    # the run's shared secret (heartbeats and records are signed with it)
    from supervisor.store.hf_rules import stored_token_path

    read(stored_token_path(env))
    values += [env.get(k, "") for k in ("TRAIN_SUPERVISOR_SMTP_PASSWORD", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                                        "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                                        "RUNPOD_API_KEY", "CONTAINER_API_KEY")]
    values += [v for k, v in env.items() if redact.secret_name(k)]
    values += [v for k, v in cfg.training.env.items() if redact.secret_name(k)]
    values += redact.command_secrets(cfg.stop.command)
    values += [cfg.notify.webhook_url, *cfg.notify.urls]
    if cfg.notify.urls_file:
        try:
            values += read_url_lines(cfg.notify.urls_file)
        except ChannelSetupError:
            pass
    values += _aws_credentials(env)
    redact.register(*values)
    return len([v for v in values if v])


def _aws_credentials(env: dict[str, str]) -> list[str]:
    """The secret keys in the AWS shared credentials file (boto3 reads them from there too)."""
    import configparser
    import os

    path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError, OSError):
        return []
    return [v for sec in cp.sections() for k, v in cp.items(sec)
            if k in ("aws_secret_access_key", "aws_session_token", "aws_security_token")]


def status_aside(status: Callable[[], dict], wait: float) -> dict | None:
    """status() for a webhook's facts, from the delivery thread. A caller may hold its own lock
    while it waits for a delivery (a flush before a stop) and status() may need that lock, so it
    runs aside; past `wait` the caller uses the last poll's snapshot instead (None here)."""
    import threading

    box: dict[str, dict] = {}

    def run() -> None:
        try:
            box["st"] = status()
        except Exception:  # noqa: BLE001 - the facts are optional; the alert goes out anyway
            log.exception("status_for_facts_failed")

    t = threading.Thread(target=run, name="facts", daemon=True)
    t.start()
    t.join(wait)
    return box.get("st")
