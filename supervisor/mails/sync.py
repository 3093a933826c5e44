"""The sync engine's words: the "sync failing" mail."""

from __future__ import annotations

from ..durations import format_bytes, format_duration
from . import Mail


def sync_failing(target: str, failing_for_s: float, last_error: str, pending_files: int, pending_bytes: int) -> Mail:
    """Uploads to `target` have failed for `failing_for_s` seconds; what is not on it yet."""
    failing_for = format_duration(failing_for_s)
    return Mail(
        f"sync failing: {target} for {failing_for}",
        f"Uploads to {target} have been failing for {failing_for}.\n"
        f"Last error: {last_error}\nNot yet on the target: {pending_files} files ({format_bytes(pending_bytes)}).\n\n"
        "Retries continue with backoff; a final sync before any stop will wait for the target.\n"
        "Check with: supervisorctl status; retry now with: supervisorctl sync --wait")
