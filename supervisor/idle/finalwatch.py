"""Moved to the stop wing (issue 51): `supervisor.stop.finalwatch`. Kept for the imports that name it."""

from supervisor.stop.finalwatch import FINAL_FAILING_KEY, POLL_S, EndSync, final_sync_watched  # noqa: F401
