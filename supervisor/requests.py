"""The arguments a control-socket request carries, checked: each wing that answers a command checks its
own with these, and a malformed request is refused with a sentence that names the problem. Pure."""

from __future__ import annotations

import os
import re
from typing import Any

from supervisor.durations import parse_duration
from supervisor.interfaces import RequestError


def checked_bool(a: dict, name: str, default: bool = False) -> bool:
    v = a.get(name, default)
    if not isinstance(v, bool):
        raise RequestError(f'"{name}" must be true or false')
    return v


def bounded_int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f'"{name}" must be a whole number from {lo} to {hi}')
    return v


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def run_context(a: dict) -> tuple[str | None, dict[str, str] | None]:
    """The folder and environment `supervisorctl run` sends (its caller's), checked."""
    cwd, env = a.get("cwd"), a.get("env")
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd) or "\0" in cwd):
        raise RequestError('run: "cwd" must be an absolute path')
    if env is not None:
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise RequestError('run: "env" must map variable names to strings')
        bad = [k for k, v in env.items() if not _ENV_NAME.fullmatch(k) or "\0" in v]
        if bad:
            raise RequestError(f"run: not a valid environment variable: {bad[0][:40]!r}")
    return cwd, env


def keepalive_seconds(a: dict) -> float | None:
    """`keepalive DURATION` checked (seconds), or None for `keepalive --cancel`."""
    if a.get("cancel"):
        return None
    d = a.get("duration")
    if not isinstance(d, str):
        raise RequestError('"keepalive" needs "duration" like "2h", or "cancel": true')
    try:
        secs = parse_duration(d)
    except ValueError:
        raise RequestError(f'keepalive: expected a duration like "2h", got {d!r}') from None
    if not 0 < secs <= 7 * 86400:
        raise RequestError("keepalive: duration must be between 1s and 7d")
    return secs


def sync_wait(a: dict) -> float | None:
    """`sync [--wait]` checked: the seconds to wait, or None for no wait."""
    wait = a.get("wait", False)
    if not isinstance(wait, bool):
        raise RequestError('"wait" must be true or false')
    if not wait:
        return None
    timeout = a.get("timeout_s", 3600)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise RequestError('"timeout_s" must be a number of seconds between 0 and 86400')
    return float(timeout)
