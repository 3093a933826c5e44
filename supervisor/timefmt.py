"""The one way this product writes a moment for people: local time with its zone (a rented server
usually runs in UTC, and then these say UTC). Mails, status lines and the alert log all use these;
machine-readable records (manifests, state files) keep epoch seconds or ISO-8601 UTC instead."""

from __future__ import annotations

import datetime as dt

from supervisor.durations import format_duration


def _local(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t).astimezone()


def when(t: float | None) -> str:
    """Date, time and zone: `2027-01-15 08:00:00 UTC`. For mails, where the reader may be anywhere."""
    if t is None:
        return "-"
    return _local(t).strftime("%Y-%m-%d %H:%M:%S %Z")


def hm(t: float | None) -> str:
    """Time of day alone, `08:00:00`: for a subject line or a status line about today."""
    if t is None:
        return "-"
    return _local(t).strftime("%H:%M:%S")


def utc_stamp(t: float) -> str:
    """ISO 8601 in UTC, to the second (what manifests and run records say when they were made)."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def stamp(t: float) -> str:
    """Date and time without the zone, for a column in a list (`supervisorctl alerts`)."""
    return _local(t).strftime("%Y-%m-%d %H:%M:%S")


def clock(t: float | None, now: float) -> str:
    """A moment relative to now, for status: `08:00:00 (in 2h)`, `07:58:00 (2m ago)`."""
    if not t:
        return "-"
    local = _local(t)
    at = local.strftime("%H:%M:%S") if abs(t - now) < 20 * 3600 else local.strftime("%Y-%m-%d %H:%M")
    delta = t - now
    rel = f"in {format_duration(delta)}" if delta > 0 else f"{format_duration(-delta)} ago"
    return f"{at} ({rel})"


def parse_moment(text: str) -> float:
    """A moment a person writes: `2026-12-05 08:00` (this machine's local time), or ISO 8601 with a
    zone (`2026-12-05T08:00:00+01:00`, `...Z`). ValueError saying what was expected."""
    s = text.strip()
    try:
        d = dt.datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise ValueError(f'expected a local time like "2026-12-05 08:00" or an ISO 8601 timestamp, '
                         f"got {text!r:.60}") from None
    return (d if d.tzinfo else d.astimezone()).timestamp()
