"""Moved to the stop wing (issue 51): the stop sequence's driver is `supervisor.stop.driver`. Kept for
the imports that name this module."""

from supervisor.stop.driver import CUT_FLOOR_S, STILL_UP_AFTER_S, StopDriver  # noqa: F401
