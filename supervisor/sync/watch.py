"""inotify (watchdog) on the watched folders: only a hint that something changed, so the engine
rescans soon instead of at the next periodic rescan. Missing folders are watched once they
appear; an inotify failure (watch limit reached) is logged and the periodic rescan carries on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from supervisor.store._log import get_logger

log = get_logger("sync.watch")


class FolderWatcher:
    def __init__(self, on_change: Callable[[str], None]):
        self.on_change = on_change
        self._also: list[Callable[[str], None]] = []  # other wings told of the same events (disk)
        self._observer = None
        self._watches: dict[str, object] = {}
        self._failed: set[str] = set()
        # a root that does not exist yet (the daemon starts at boot, the trainer makes its output
        # folder later): its nearest existing parent is watched, not recursively, until it appears
        self._parents: dict[str, object] = {}
        self._was_missing: set[str] = set()  # roots seen missing: news when they are watched at last
        self._lock = threading.Lock()

    def also(self, fn: Callable[[str], None]) -> None:
        """Tell `fn` of every change too: one inotify watcher serves the sync and the disk wing."""
        self._also.append(fn)

    def _tell(self, path: str) -> None:
        self.on_change(path)
        for fn in self._also:
            try:
                fn(path)
            except Exception:  # noqa: BLE001 - one listener's bug must not starve the others
                log.exception("watch_listener_failed")

    def ensure(self, roots: list[str]) -> None:
        """Watch every root that exists now, and the way to those that do not (cheap to call on
        every rescan)."""
        for _ in range(8):  # `mkdir -p a/b/c` under a watched parent: follow it down, level by level
            appeared, waiting = self._ensure(roots)
            for root in appeared:
                if root in self._was_missing:
                    self._was_missing.discard(root)
                    self._tell(root)  # made while we looked away: whatever is in it is news
            if not any(os.path.isdir(r) for r in waiting):
                return

    def _ensure(self, roots: list[str]) -> tuple[list[str], list[str]]:
        appeared: list[str] = []
        missing: list[str] = []
        with self._lock:
            waiting: set[str] = set()
            for root in roots:
                if root in self._watches or root in self._failed:
                    continue
                if not os.path.isdir(root):
                    parent = _nearest_parent(root)
                    if parent is not None:
                        waiting.add(parent)
                        missing.append(root)
                        self._was_missing.add(root)
                    continue
                try:
                    obs = self._get_observer()
                    self._watches[root] = obs.schedule(_Handler(self._tell), root, recursive=True)
                    log.info("sync_watching", folder=root)
                    appeared.append(root)
                except (OSError, RuntimeError) as e:
                    self._failed.add(root)
                    log.warning("sync_watch_failed", folder=root, error=str(e),
                                note="relying on the periodic rescan")
            self._watch_parents(waiting, roots)
        return appeared, missing

    def _watch_parents(self, wanted: set[str], roots: list[str]) -> None:
        for parent in [p for p in self._parents if p not in wanted]:
            self._unschedule(self._parents.pop(parent))
        for parent in wanted - set(self._parents):
            try:
                handler = _Handler(lambda path, roots=tuple(roots): self._nearer(path, roots))
                self._parents[parent] = self._get_observer().schedule(handler, parent, recursive=False)
            except (OSError, RuntimeError) as e:
                log.warning("sync_watch_failed", folder=parent, error=str(e), note="relying on the periodic rescan")

    def _nearer(self, path: str, roots: tuple[str, ...]) -> None:
        """Something was made in a parent we watch for a missing root: look again, from a thread
        of our own (watchdog's own thread must not schedule or unschedule)."""
        if any(r == path or r.startswith(path.rstrip("/") + "/") for r in roots):
            threading.Thread(target=self.ensure, args=(list(roots),), name="watch-appear", daemon=True).start()

    def _unschedule(self, w: object) -> None:
        try:
            if self._observer is not None:
                self._observer.unschedule(w)
        except (KeyError, OSError, RuntimeError):
            pass

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
                self._unschedule(self._watches.pop(root))

    def close(self) -> None:
        with self._lock:
            obs, self._observer = self._observer, None
            self._watches.clear()
            self._parents.clear()
        if obs is not None:
            try:
                obs.stop()
                obs.join(5)
            except RuntimeError:
                pass


def _nearest_parent(path: str) -> str | None:
    p = os.path.dirname(os.path.normpath(path))
    while p and not os.path.isdir(p):
        if os.path.dirname(p) == p:
            return None
        p = os.path.dirname(p)
    return p or None


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
