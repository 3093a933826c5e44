"""How many saves the target is behind: each unit's versions seen whole here since the one the target holds.

A save is a version of a unit (a file's size, mtime and inode; a folder's, of each of its files) seen whole:
by a scan (its verdict, or a single file's format check), by an inotify hint on a single checkpoint
file (a stat, then its format check, then the same version again), or by a look at the file while its
snapshot goes up. The worker does not scan while it sends, so without the hints a file rewritten
every few seconds during a ten-minute upload would count one save per upload, and a target 45 saves
behind would look one behind. targethealth.Behind says so, and alerts, past BEHIND_SAVES. Kept in
memory: a restarted daemon counts from the version it finds.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from supervisor.saves.complete import Verdict, checkable, safetensors_whole, zip_whole
from supervisor.untrusted import SAFETENSORS_PARSE_MAX, ZIP_LOCAL_MAGIC, ZIP_TAIL, safetensors_header_len
from supervisor.untrusted.fileopen import open_regular


@dataclass(frozen=True)
class Lag:
    """One unit's saves here against its version on the target (saves.counts.Saves counts them)."""

    unit: str             # its key (status's `unit`, the alert's key)
    path: str             # where it is here
    saves: int            # saves seen since the version the target holds
    since: float | None   # wall time of the first of them (its mtime)
    note: str = ""        # why it goes up without a snapshot, when it does

class Unit(Protocol):
    """A unit as the scan hands it in (sync.scan.Unit): a folder or a single file and what it holds."""

    key: str
    kind: str                  # "dir" or "file"
    label: str
    selected: list             # sync.scan.Selected: path, size, mtime_ns, ino, ctime_ns ...
    files: list                # saves.complete.FileObs
    verdict: Verdict


class Teller(Protocol):
    """Who is told the counts (sync.targethealth.Behind: status and the "target behind" alerts)."""

    def update(self, lags: list[Lag], alive: set[str]) -> None: ...


KEEP_VERSIONS = 64         # versions remembered per unit (their save numbers)
WHOLE_KINDS = ("zip", "safetensors")       # formats whose own header or end record says "whole"

Version = tuple  # of a file: (size, mtime_ns, inode); of a folder: (rel, size, mtime_ns, inode) per file


def version_of(u: Unit) -> Version:
    if u.kind == "file":
        s = u.selected[0]
        return (s.size, s.mtime_ns, s.ino)
    return tuple(sorted((s.rel, s.size, s.mtime_ns, s.ino) for s in u.selected))


# --- reading a file's format check -----------------------------------------------------------------

def whole_fd(fd: int, kind: str, size: int) -> bool | None:
    """complete.py's format check on an open file (walk.read_whole's, on a descriptor)."""
    if kind == "zip":
        if os.pread(fd, 4, 0) != ZIP_LOCAL_MAGIC:
            return None
        n = min(size, ZIP_TAIL)
        return zip_whole(os.pread(fd, n, size - n))
    if kind == "safetensors":
        first8 = os.pread(fd, 8, 0)
        n = safetensors_header_len(first8)
        if n is None or 8 + n > size:
            return False
        return None if n > SAFETENSORS_PARSE_MAX else safetensors_whole(first8, os.pread(fd, n, 8), size)
    return None


def whole_at(path: str, kind: str, v: Version) -> bool:
    """Is the file at `path` this version (size, mtime, inode) and whole by its format check?
    Opened like every file the training wrote: no link followed, no FIFO waited on."""
    try:
        fd = open_regular(path)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != v or whole_fd(fd, kind, st.st_size) is not True:
            return False
        st = os.fstat(fd)
        return (st.st_size, st.st_mtime_ns, st.st_ino) == v
    except OSError:
        return False
    finally:
        os.close(fd)


# --- the saves of each unit ------------------------------------------------------------------------

@dataclass
class Track:
    label: str
    path: str
    kind: str
    count: int = 0                 # whole versions seen since the engine started
    numbers: dict[Version, int] = field(default_factory=dict)   # version -> its save number
    saved_at: dict[int, float] = field(default_factory=dict)    # save number -> its mtime (wall)
    on_target: int = 0             # the save number the target holds (0: none seen by this daemon)
    last: Version | None = None    # a file's newest version seen, whole or not
    in_place: bool | None = None   # its last change kept the inode (True) or brought a new one (False)
    aborted: bool = False          # an upload of it stopped because it changed underneath
    note: str = ""                 # why it goes up without a snapshot ("" when it needs none or has one)

    def saw(self, v: Version, mtime: float) -> bool:
        """Count a whole version; False when it was counted already."""
        if v in self.numbers:
            return False
        self.count += 1
        self.numbers[v] = self.count
        self.saved_at[self.count] = mtime
        if len(self.numbers) > KEEP_VERSIONS:
            del self.numbers[min(self.numbers, key=self.numbers.__getitem__)]
        for n in [n for n in self.saved_at if n <= self.on_target]:
            del self.saved_at[n]
        return True

    def moved(self, v: Version) -> None:
        if self.last is not None and v != self.last and v[2] and self.last[2]:
            self.in_place = v[2] == self.last[2]
        self.last = v

    def lag(self) -> Lag:
        later = [t for n, t in self.saved_at.items() if n > self.on_target]
        return Lag(self.label, self.path, max(0, self.count - self.on_target), min(later) if later else None,
                   self.note)


class Saves:
    """Each unit's saves here against the one on the target; fed by the scans (look), the inotify
    hints (hint: the watcher's thread) and the snapshot uploads (SnapshotTarget)."""

    def __init__(self, behind: Teller):
        self.behind = behind
        self.tracks: dict[str, Track] = {}
        self._paths: dict[str, str] = {}  # a single file's path -> its unit key (what hint() looks at)
        self._lock = threading.Lock()

    def look(self, units: Iterable[Unit], synced: Callable[[Unit], bool]) -> None:
        """After a scan: count each unit's version if whole, and note the one the target holds."""
        tracks: dict[str, Track] = {}
        paths: dict[str, str] = {}
        for u in units:
            if not u.selected or u.retired:
                continue
            on_target = synced(u)
            v = version_of(u)
            with self._lock:
                t = tracks[u.key] = self.tracks.get(u.key) or Track(u.label, u.abspath, u.kind)
                if u.kind == "file":
                    t.moved(v)
                    paths[u.selected[0].path] = u.key
                whole = u.verdict.complete or (u.kind == "file" and any(f.whole is True for f in u.files))
                if whole:
                    t.saw(v, max(s.mtime_ns for s in u.selected) / 1e9)
                if on_target:
                    t.on_target = t.numbers.get(v, t.count)
        with self._lock:
            self.tracks, self._paths = tracks, paths
        self.publish()

    def hint(self, path: str) -> None:
        """The watcher saw `path` change: a single checkpoint file whose new version is whole (its
        format check, then the same version again) is a save, counted though no scan may ever see it
        (the worker is busy sending, and the writer saves again before it looks)."""
        key = self._paths.get(path)  # most hints are of other files: one dict lookup
        if key is None:
            return
        kind = checkable(os.path.basename(path))
        if kind not in WHOLE_KINDS:
            return
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return
        v = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            t = self.tracks.get(key)
            if t is None or not stat.S_ISREG(st.st_mode):
                return
            t.moved(v)
            if v in t.numbers:
                return
        if not whole_at(path, kind, v):
            return
        with self._lock:
            counted = t.saw(v, st.st_mtime_ns / 1e9)
        if counted:
            self.publish()

    def sent(self, key: str, v: Version) -> None:
        """The target holds this version of the unit now."""
        with self._lock:
            t = self.tracks.get(key)
            n = t.numbers.get(v) if t is not None else None
            if t is None or n is None or n <= t.on_target:
                return
            t.on_target = n
        self.publish()

    def track(self, key: str) -> Track | None:
        with self._lock:
            return self.tracks.get(key)

    def mark(self, key: str, aborted: bool | None = None, note: str | None = None) -> None:
        with self._lock:
            t = self.tracks.get(key)
            if t is None:
                return
            if aborted is not None:
                t.aborted = aborted
            if note is not None:
                t.note = note

    def publish(self) -> None:
        with self._lock:
            lags = [t.lag() for t in self.tracks.values()]
            alive = set(self.tracks)
        self.behind.update(lags, alive)
