"""Human durations and sizes ("2h", "90s", "1h30m", "512M") in both directions."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SIZE_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in `text`; ValueError when it is not a duration like "2h", "90s" or "1h30m".

    A bare "0" is accepted (it reads naturally as "never wait"); any other bare number is
    rejected because "30" could mean seconds or minutes and a wrong guess costs money.
    """
    s = text.strip().lower().replace(" ", "")
    if s == "0":
        return 0.0
    if not s:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    for m in _PART.finditer(s):
        if m.start() != pos:
            raise ValueError(f"not a duration: {text!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s):
        raise ValueError(f"not a duration: {text!r}")
    return total


def format_duration(seconds: float | None) -> str:
    """Compact "1h05m", "42s", "3d04h"; "unknown" for None or negative."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "unknown"
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def format_hms(seconds: float) -> str:
    """supervisorctl's uptime format H:MM:SS."""
    s = max(0, int(seconds))
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{h}:{m:02d}:{s:02d}"


def parse_size(text: str | int) -> int:
    """Bytes in "512M", "8MiB", "1G", or a plain integer."""
    if isinstance(text, bool):
        raise ValueError("not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("negative size")
        return text
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def format_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
