"""Persisted state: small JSON documents in state_dir, written atomically (temp, fsync, rename).

A corrupt or truncated file is never fatal: it is renamed aside (`NAME.corrupt-TIMESTAMP`), the
problem is logged with the file's name, and the caller starts from its default.

A write that fails raises `StateWriteError` (an OSError naming the file and the cause); callers
keep their state in memory and carry on. A full disk is the usual cause (checkpoints filled it):
`Reserve` keeps a few preallocated MiB in state_dir that the first write to hit ENOSPC frees, so
the daemon can still record a stop and an alert after the disk filled up.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

FULL = (errno.ENOSPC, errno.EDQUOT)
RESERVE_NAME = ".reserve"
RESERVE_BYTES = 4 * 1024 * 1024


class StateWriteError(OSError):
    """A state file could not be written; the old file (if any) is untouched."""

    def __init__(self, path: Path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path = Path(path)
        self.cause = cause

    @property
    def disk_full(self) -> bool:
        return self.errno in FULL

    def __str__(self) -> str:
        why = self.strerror or "write failed"
        return f"cannot save {self.path}: {why}" + (" (the disk is full)" if self.disk_full else "")


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written: a write may take only part of the buffer (a filling
    disk, a signal); what did not fit raises instead of being dropped silently."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"short write: {len(data) - len(view)} of {len(data)} bytes written")
        view = view[n:]


def _write_once(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)  # some filesystems report ENOSPC only here
            if os.fstat(fd).st_size != len(data):
                raise OSError(errno.EIO, f"{tmp} holds {os.fstat(fd).st_size} bytes, not {len(data)}")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data` (a reader sees the old or the new file, never a mix). On a full
    disk the state_dir reserve is freed and the write tried once more. Raises StateWriteError."""
    path = Path(path)
    try:
        _write_once(path, data, mode)
        return
    except OSError as e:
        first = e
    if first.errno in FULL and release_reserve(path.parent):
        try:
            _write_once(path, data, mode)
            return
        except OSError as e:
            first = e
    raise StateWriteError(path, first) from first


class Reserve:
    """A preallocated file in state_dir, given up the first time a state write finds the disk full.

    The space it frees is for the daemon's own small writes (stop record, alert log, ledger lines);
    a trainer writing to the same disk can take it first, so this buys a chance, not a promise:
    the callers must still carry on when a save fails."""

    def __init__(self, state_dir: str | Path, size: int = RESERVE_BYTES):
        self.path = Path(state_dir) / RESERVE_NAME
        self.size = size
        self.released_at: float | None = None
        self._lock = threading.Lock()

    def register(self) -> Reserve:
        """Let atomic_write (and the ledger) in this process free it on ENOSPC."""
        with _registry_lock:
            if all(r.path != self.path for r in _reserves):
                _reserves.append(self)
        return self

    def armed(self) -> bool:
        try:
            return self.path.stat().st_size >= self.size
        except OSError:
            return False

    def arm(self, min_free: int | None = None) -> bool:
        """Create the reserve when it is missing and the disk has room for it and `min_free`
        more (default: its size again, so re-arming never fills the disk). True when armed."""
        with self._lock:
            if self.armed():
                return True
            try:
                st = os.statvfs(self.path.parent)
            except OSError:
                return False
            if st.f_bavail * st.f_frsize < self.size + (self.size if min_free is None else min_free):
                return False
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    try:
                        os.posix_fallocate(fd, 0, self.size)
                    except OSError as e:
                        if e.errno in FULL:
                            raise
                        write_all(fd, bytes(self.size))  # no fallocate here: real blocks do the same
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                _log("error", "state_reserve_not_made", path=str(self.path), error=e.strerror or str(e))
                return False
            if self.released_at is not None:
                _log("info", "state_reserve_rearmed", path=str(self.path))
            self.released_at = None
            return True

    def release(self) -> bool:
        """Free the reserve; True when that freed space (it existed)."""
        with self._lock:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return False
            except OSError as e:
                _log("error", "state_reserve_release_failed", path=str(self.path), error=e.strerror or str(e))
                return False
            self.released_at = time.time()
        _log("error", "state_dir_full", path=str(self.path.parent), released_bytes=self.size,
             note="the disk under state_dir is full: freed the reserve so state can still be saved")
        return True

    def problem(self) -> str | None:
        if self.released_at is None:
            return None
        return (f"{self.path.parent}: the disk filled up; its {self.size // (1024 * 1024)} MiB reserve was "
                "used so state could still be saved. Free space on that disk.")


_reserves: list[Reserve] = []
_registry_lock = threading.Lock()


def release_reserve(path: str | Path) -> bool:
    """Free a registered reserve on the same filesystem as `path`; True when one was freed."""
    dev = None
    for p in (Path(path), *Path(path).parents):  # the folder itself may be what could not be made
        try:
            dev = os.stat(p).st_dev
            break
        except OSError:
            continue
    if dev is None:
        return False
    with _registry_lock:
        candidates = list(_reserves)
    for r in candidates:
        try:
            same = os.stat(r.path.parent).st_dev == dev
        except OSError:
            continue
        if same and r.release():
            return True
    return False


def _log(level: str, event: str, **kw: Any) -> None:
    import structlog  # here, not at import: the sync one-shot pass uses atomic_write and stays light

    getattr(structlog.get_logger("statefile"), level)(event, **kw)


def secure_state_dir(state_dir: str | Path, group: str = "") -> list[str]:
    """Create state_dir as 0700, or 0750 owned by `group` (the socket_group: its members may read
    the default training log there, nothing else), and take group/other access away from state
    files an older version wrote 0644 (run specs hold training.env). Returns problems to show."""
    import grp

    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    problems: list[str] = []
    mode = 0o700
    if group:
        try:
            os.chown(d, -1, grp.getgrnam(group).gr_gid)
            mode = 0o750
        except KeyError:
            problems.append(f"socket_group {group!r} does not exist: {d} stays 0700 (root only)")
        except OSError as e:
            problems.append(f"cannot give {d} to group {group!r}: {e.strerror or e}; it stays 0700")
    try:
        os.chmod(d, mode)
    except OSError as e:
        problems.append(f"cannot set {d} to {oct(mode)}: {e.strerror or e}")
    for base, dirs, files in os.walk(d):
        if base.count(os.sep) - str(d).count(os.sep) >= 3:
            dirs[:] = []
        for name in files:
            if not (name.endswith((".json", ".jsonl", ".tmp", ".exit")) or ".corrupt-" in name
                    or name in ("pid", "lock", "stop-action.log", RESERVE_NAME)):
                continue  # the training log (members may tail it) and sockets keep their modes
            p = os.path.join(base, name)
            try:
                st = os.lstat(p)
                if st.st_mode & 0o077 and not os.path.islink(p):
                    os.chmod(p, st.st_mode & 0o700)
            except OSError:
                pass
    return problems


def set_aside(path: Path, now: float | None = None) -> Path:
    """Rename a damaged state file to `NAME.corrupt-TIMESTAMP` so it can be looked at later and the
    caller can start afresh; returns the new path (the old one when the rename failed)."""
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time() if now is None else now)}")
    try:
        os.replace(path, aside)
    except OSError:
        return path
    return aside


class StateStore:
    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self._lock = threading.Lock()
        self.problems: list[str] = []  # shown in status so a set-aside file is not silent
        self.unsaved: dict[str, str] = {}  # name -> why its last save failed (cleared by the next success)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def load(self, name: str, default: Any = None) -> Any:
        p = self.path(name)
        with self._lock:
            try:
                raw = p.read_bytes()
            except FileNotFoundError:
                return default
            except OSError as e:
                self._note(f"{p}: unreadable ({e}); starting from defaults")
                return default
            try:
                return json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                aside = set_aside(p)
                self._note(f"{p}: corrupt state file ({e}); set aside as {aside.name}, starting from defaults")
                return default

    def save(self, name: str, data: Any) -> None:
        """Write `name`.json atomically. Raises StateWriteError (an OSError) when it cannot: the
        caller keeps `data` in memory and goes on; status shows the file as unsaved until a later
        save succeeds."""
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        with self._lock:
            try:
                atomic_write(self.path(name), blob)
            except StateWriteError as e:
                if name not in self.unsaved:
                    _log("error", "state_file_not_saved", file=str(e.path), error=str(e))
                self.unsaved[name] = f"{e}; kept in memory, retried on the next change"
                raise
            if self.unsaved.pop(name, None) is not None:
                _log("info", "state_file_saved_again", file=str(self.path(name)))

    def _note(self, msg: str) -> None:
        self.problems.append(msg)
        _log("error", "state_file_problem", problem=msg)
