"""inotify (watchdog) on the watched folders: only a hint that something changed, so the engine
rescans soon instead of at the next periodic rescan. Missing folders are watched once they
appear; an inotify failure (watch limit reached) is logged and the periodic rescan carries on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from supervisor.sync._log import get_logger

log = get_logger("sync.watch")


class FolderWatcher:
    def __init__(self, on_change: Callable[[str], None]):
        self.on_change = on_change
        self._observer = None
        self._watches: dict[str, object] = {}
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, roots: list[str]) -> None:
        """Watch every root that exists now (cheap to call on every rescan)."""
        with self._lock:
            for root in roots:
                if root in self._watches or root in self._failed or not os.path.isdir(root):
                    continue
                try:
                    obs = self._get_observer()
                    self._watches[root] = obs.schedule(_Handler(self.on_change), root, recursive=True)
                    log.info("sync_watching", folder=root)
                except (OSError, RuntimeError) as e:
                    self._failed.add(root)
                    log.warning("sync_watch_failed", folder=root, error=str(e),
                                note="relying on the periodic rescan")

    def _get_observer(self):
        if self._observer is None:
            from watchdog.observers import Observer

            obs = Observer()
            obs.daemon = True
            obs.start()
            self._observer = obs
        return self._observer

    def forget_missing(self) -> None:
        """Drop watches whose folder disappeared, so they are set up again when it returns."""
        with self._lock:
            for root in [r for r in self._watches if not os.path.isdir(r)]:
                w = self._watches.pop(root)
                try:
                    if self._observer is not None:
                        self._observer.unschedule(w)
                except (KeyError, OSError, RuntimeError):
                    pass

    def close(self) -> None:
        with self._lock:
            obs, self._observer = self._observer, None
            self._watches.clear()
        if obs is not None:
            try:
                obs.stop()
                obs.join(5)
            except RuntimeError:
                pass


class _Handler:
    """watchdog's dispatch protocol without subclassing (keeps the import lazy)."""

    def __init__(self, on_change: Callable[[str], None]):
        self.on_change = on_change

    def dispatch(self, event) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        try:
            self.on_change(os.fsdecode(event.src_path))
        except Exception:  # noqa: BLE001 - the observer thread must survive anything
            log.exception("sync_watch_callback_failed")
