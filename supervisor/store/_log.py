"""structlog, imported on the first log call.

`python -m supervisor.sync --once` with nothing to send logs nothing; importing structlog (and
the asyncio it pulls in) would be most of that process's run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

on_first_use: Callable[[], None] | None = None  # __main__ sets this to configure logging
# __main__ sets this from the config too: until structlog is loaded, a call below it is dropped
# here (a one-shot run at "warning" then never imports structlog for its info lines)
min_level = 0
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "exception": 40, "critical": 50}


def _drop(*_a: Any, **_k: Any) -> None:
    return None


class LazyLogger:
    def __init__(self, name: str):
        self._name = name
        self._log: Any = None

    def __getattr__(self, item: str) -> Any:
        if self._log is None:
            if LEVELS.get(item, 100) < min_level:
                return _drop
            global on_first_use
            hook, on_first_use = on_first_use, None
            if hook is not None:
                hook()
            import structlog

            self._log = structlog.get_logger(self._name)
        return getattr(self._log, item)


def get_logger(name: str) -> LazyLogger:
    return LazyLogger(name)


class Once:
    """Log a recurring problem (an unreadable folder, a busy ledger) once per key, not once per scan."""

    LIMIT = 10000

    def __init__(self, logger: LazyLogger):
        self._log = logger
        self._keys: set[str] = set()

    def warning(self, key: str, event: str, **kw: Any) -> None:
        if key in self._keys:
            return
        if len(self._keys) > self.LIMIT:
            self._keys.clear()
        self._keys.add(key)
        self._log.warning(event, **kw)
