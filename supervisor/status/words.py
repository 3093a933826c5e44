"""The few phrasings the status text shares with the mails (the notify wing re-exports them): how a
process ended, money, a step rate, a file the upload cannot keep up with, output no include selects.
Here, in the core, because the status blocks may import no wing."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

from supervisor.durations import format_bytes

# What the shell's own exit codes mean (the job runs under `bash -c`): the first thing to check.
EXIT_MEANING = {
    126: ": found but not executable (permission denied, or not a program)",
    127: ": command not found (not on the PATH the job ran with)",
}
CURRENCY_SIGNS = {"EUR": "€", "USD": "$", "GBP": "£", "JPY": "¥", "INR": "₹"}
UNSELECTED_FIX = "add a sync.include glob; see docs/sync.md"


def describe_exit(exit_code: int | None, signal: str | None) -> str:
    """How a process ended, in the words every mail and status line uses."""
    if signal:
        return f"killed by {signal}"
    if exit_code is None:
        return "exit status unknown"
    return f"exit code {exit_code}{EXIT_MEANING.get(exit_code, '')}"


def money(x: float | None, currency: str) -> str:
    """Cents rounded half up, as on an invoice (8.125 -> 8.13; binary floats would say 8.12)."""
    if x is None or not math.isfinite(x):
        return "unknown"
    cents = Decimal(repr(round(x, 6))).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    sym = CURRENCY_SIGNS.get(currency)
    return f"{sym}{cents:,}" if sym else f"{currency} {cents:,}"


def steps_rate(sps: float) -> str:
    if sps >= 1 or sps == 0:
        return f"{sps:.2f} steps/s"
    return f"{1 / sps:.1f} s/step"


def behind_line(path: str, saves: int) -> str:
    """`target 45 saves behind for /w/out/ckpt.pt: the file is rewritten faster than it uploads`:
    status and the alert's mail say it alike."""
    return f"target {saves} saves behind for {path}: the file is rewritten faster than it uploads"


def unselected_line(files: int, nbytes: int, names: list[str] | tuple[str, ...], items: int = 0, shown: int = 3) -> str:
    """`3 files, 48.0 MiB in the watched folders are NOT selected: /w/out/ckpt.pt, ... (add a
    sync.include glob; see docs/sync.md)`: status, `sync --wait` and the mails' subject lines."""
    more = max(items, len(names)) - min(shown, len(names))
    listed = ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
    verb = "is" if files == 1 else "are"
    return (f"{files} file{'' if files == 1 else 's'}, {format_bytes(nbytes)} in the watched folders {verb} "
            f"NOT selected: {listed} ({UNSELECTED_FIX})")
