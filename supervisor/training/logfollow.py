"""Follow the training log as it grows and hand each new line to the listeners (OOM detector,
progress tracker).

Reads only what was appended since the last poll, bounded per poll, through an open descriptor so
a rotated file (renamed away, a new one created) is read to its end before the new one is started
from its beginning; a truncated file (copytruncate, `> train.log`) is read again from the start and
the listeners are reset. Lines end at \\n or \\r (tqdm redraws its bar with \\r: each redraw is a
line); a partial last line waits for its end, up to a cap and a few seconds. Bytes are decoded as
UTF-8 with replacement, so binary garbage cannot stop the follower.

With a StateStore, where it has got to (the file's device, inode and the offset of the first byte
not yet handed on) is saved after every poll that handed on lines, so a restarted daemon resumes
there and an OOM printed while it was down is still seen: the same file continues from the saved
offset, a file replaced meanwhile is read from its beginning, and either replay is capped to its
last `max_replay` bytes (from the first line start within them).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import structlog

from supervisor import records
from supervisor.interfaces import Duty, LineListener
from supervisor.statefile import StateStore, set_aside
from supervisor.training.safeopen import UnsafeLog, open_log

log = structlog.get_logger("logfollow")

_EOL = re.compile(rb"[\r\n]")
STATE_NAME = "logfollow"
HEAD_BYTES = 4096   # a file's first bytes tell it from another that got the same inode number


@dataclass(frozen=True)
class Position:
    """Where the follower has got to in `path`: the file (device, inode) and the first byte not yet
    handed to the listeners."""

    path: str
    dev: int
    ino: int
    offset: int
    head_len: int = 0     # how many of the file's first bytes `head` is the SHA-256 of
    head: str = ""

    def __post_init__(self) -> None:
        for name in ("offset", "head_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{STATE_NAME}.json: {name} should not be negative, got {getattr(self, name)}")


class LogFollower:
    def __init__(self, path: str, listeners: Sequence[LineListener], start_at_end: bool = False,
                 max_bytes_per_poll: int = 4 * 1024 * 1024, max_line: int = 64 * 1024,
                 max_backlog: int = 64 * 1024 * 1024, partial_flush_s: float = 5.0,
                 store: StateStore | None = None, max_replay: int = 8 * 1024 * 1024,
                 user: str | None = None, since: str | None = None, clock: Callable[[], float] = time.time):
        self.clock = clock  # wall time for the listeners, read at each of the duty's polls
        self.user = user   # training.user: the log is opened as the runner opens it (safeopen)
        self._unsafe = ""
        self.listeners = list(listeners)
        self.max_bytes_per_poll = max_bytes_per_poll
        self.max_line = max_line
        self.max_backlog = max_backlog
        self.partial_flush_s = partial_flush_s
        self.store = store
        self.max_replay = max_replay
        self._lock = threading.Lock()
        self.path = ""
        self._fd: int | None = None
        self._id: tuple[int, int] | None = None   # (st_dev, st_ino) of the open file
        self._offset = 0
        self._buf = b""
        self._skip_partial = False                # a capped replay starts mid-line: drop that piece
        self._partial_since: float | None = None
        self._saved: Position | None = self._load_position()
        self.lines_fed = 0
        self.bytes_skipped = 0
        self.listener_errors: dict[str, int] = {}
        self.switch(path, start_at_end=start_at_end, since=since)

    # --- control -------------------------------------------------------------------------------
    def switch(self, path: str, start_at_end: bool = False, since: str | None = None) -> None:
        """Follow `path` from now on. The path followed now keeps its position (nothing is read twice
        or skipped; a file replaced meanwhile is handled by `poll` like a rotation); another file is
        opened at its end when start_at_end (a daemon restart must not re-alert old OOM lines), else
        at its start. A file that does not exist yet is read from its beginning once it appears.
        A position saved for `path` by an earlier daemon overrules start_at_end (see the module).
        With no saved position and `since` (the current run's banner), the file is read from the
        last line that starts with `since` (capped to max_replay like a resume): what a training
        printed in its first seconds, while no daemon had yet saved a position, is not skipped."""
        with self._lock:
            path = path or ""
            if path == self.path:
                return
            self._close()
            self.path = path
            self._buf = b""
            self._skip_partial = False
            self._partial_since = None
            if path and self._open():
                try:
                    size = os.fstat(self._fd).st_size  # type: ignore[arg-type]
                except OSError:
                    size = 0
                resume = self._resume_offset(size)
                if resume is None and since:
                    resume = self._banner_offset(since, size)
                if resume is not None:
                    self._offset = resume
                elif start_at_end:
                    self._offset = size
                self._save_position()

    def close(self) -> None:
        with self._lock:
            self._close()

    # --- the duty ------------------------------------------------------------------------------
    def duties(self) -> tuple[Duty, ...]:
        return (Duty("log", 2.0, lambda: self.poll(self.clock())),)

    def poll(self, now: float) -> int:
        """Read what was appended; returns the number of lines fed. Never raises."""
        with self._lock:
            try:
                fed = self._poll(now)
            except Exception:  # noqa: BLE001 - a log we cannot read must not stop the daemon
                log.exception("log_follow_failed", path=self.path)
                return 0
            if fed:
                self._save_position()
            return fed

    def _poll(self, now: float) -> int:
        if not self.path:
            return 0
        fed = 0
        if self._fd is not None and not self._same_file():
            # rotated or removed: finish the old file, then start the new one from its beginning
            fed += self._read(now)
            fed += self._flush_partial(now)
            self._close()
        if self._fd is None:
            if not self._open():
                return fed
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size < self._offset:
            log.info("log_truncated", path=self.path, size=size, offset=self._offset)
            self._offset = 0
            self._buf = b""
            self._skip_partial = False
            self._partial_since = None
            for li in self.listeners:
                self._call(li.reset, now)
        backlog = size - self._offset
        if backlog > self.max_backlog:
            # far behind (a flood of output): keep the tail, where an OOM traceback would be
            skip = backlog - self.max_bytes_per_poll
            log.warning("log_follow_skipped", path=self.path, skipped_bytes=skip)
            self._offset += skip
            self.bytes_skipped += skip
            self._buf = b""
        fed += self._read(now)
        if self._buf and self._partial_since is not None and now - self._partial_since >= self.partial_flush_s:
            fed += self._flush_partial(now)
        return fed

    # --- the saved position ----------------------------------------------------------------------
    def _load_position(self) -> Position | None:
        if self.store is None:
            return None
        raw = self.store.load(STATE_NAME, None)
        if raw is None:
            return None
        try:
            return records.load(Position, raw, f"{STATE_NAME}.json")
        except ValueError as e:
            aside = set_aside(self.store.path(STATE_NAME))
            self.store.problems.append(f"{e}; set aside as {aside.name}, the log is followed from its end")
            log.warning("log_position_unusable", error=str(e), set_aside=str(aside))
            return None

    def _resume_offset(self, size: int) -> int | None:
        """Where to start in the file just opened, from the saved position; None: no position."""
        pos, self._saved = self._saved, None   # only the first open of that path resumes
        if pos is None or pos.path != self.path:
            return None
        same = ((pos.dev, pos.ino) == self._id and pos.offset <= size and pos.head_len <= size
                and self._head(pos.head_len) == pos.head)
        start = pos.offset if same else 0
        if size - start > self.max_replay:
            skip = size - self.max_replay - start
            log.warning("log_replay_capped", path=self.path, skipped_bytes=skip)
            self.bytes_skipped += skip
            start = size - self.max_replay
            self._skip_partial = not self._at_line_start(start)
        if start < size:
            log.info("log_resumed", path=self.path, offset=start, replay_bytes=size - start, same_file=same)
        return start

    def _banner_offset(self, since: str, size: int) -> int | None:
        """The offset of the last line starting with `since` within the last max_replay bytes
        (None: not there, e.g. an older run's log); the replay from it is capped like a resume."""
        start = max(0, size - self.max_replay)
        try:
            data = os.pread(self._fd, size - start, start)  # type: ignore[arg-type]
        except OSError:
            return None
        needle = since.encode(errors="replace")
        i = data.rfind(b"\n" + needle)
        if i >= 0:
            i += 1
        elif start == 0 and data.startswith(needle):
            i = 0
        else:
            return None
        log.info("log_read_from_run_start", path=self.path, offset=start + i, replay_bytes=size - start - i)
        return start + i

    def _head(self, n: int) -> str:
        if n <= 0:
            return ""
        try:
            data = os.pread(self._fd, n, 0)  # type: ignore[arg-type]
        except OSError:
            return "?"  # unreadable: matches no saved head, so the file is read from its start
        return hashlib.sha256(data).hexdigest() if len(data) == n else "?"

    def _at_line_start(self, offset: int) -> bool:
        if offset <= 0:
            return True
        try:
            return os.pread(self._fd, 1, offset - 1) in (b"\n", b"\r")  # type: ignore[arg-type]
        except OSError:
            return False

    def _save_position(self) -> None:
        if self.store is None or self._id is None:
            return
        # the partial line not yet handed on is read again by the next daemon
        offset = max(0, self._offset - len(self._buf))
        n = min(offset, HEAD_BYTES)
        pos = Position(self.path, self._id[0], self._id[1], offset, n, self._head(n))
        try:
            self.store.save(STATE_NAME, asdict(pos))
        except OSError as e:
            log.warning("log_position_save_failed", error=str(e))

    # --- internals -----------------------------------------------------------------------------
    def _open(self) -> bool:
        try:
            fd = open_log(self.path, os.O_RDONLY | os.O_NONBLOCK, self.user)
        except UnsafeLog as e:
            if self._unsafe != str(e):  # once, not every poll
                self._unsafe = str(e)
                log.warning("log_unsafe", path=self.path, error=str(e))
            return False
        except OSError:
            return False
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        self._id = (st.st_dev, st.st_ino)
        self._offset = 0
        return True

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None
        self._id = None

    def _same_file(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._id

    def _read(self, now: float) -> int:
        assert self._fd is not None
        budget = self.max_bytes_per_poll
        fed = 0
        while budget > 0:
            try:
                chunk = os.pread(self._fd, min(256 * 1024, budget), self._offset)
            except OSError as e:
                log.warning("log_read_failed", path=self.path, error=str(e))
                break
            if not chunk:
                break
            self._offset += len(chunk)
            budget -= len(chunk)
            fed += self._split(chunk, now)
        return fed

    def _split(self, chunk: bytes, now: float) -> int:
        parts = _EOL.split(self._buf + chunk)
        self._buf = parts.pop()
        if self._skip_partial and parts:
            parts = parts[1:]  # the tail of a line whose start lies before the replay window
            self._skip_partial = False
        fed = 0
        for raw in parts:
            if raw:
                fed += self._feed(raw, now)
        if len(self._buf) > self.max_line:
            # a "line" with no end in sight (binary output, a progress bar without \r): cut it
            while len(self._buf) > self.max_line:
                fed += self._feed(self._buf[: self.max_line], now)
                self._buf = self._buf[self.max_line:]
        if self._buf:
            if self._partial_since is None:
                self._partial_since = now
        else:
            self._partial_since = None
        return fed

    def _flush_partial(self, now: float) -> int:
        raw, self._buf, self._partial_since = self._buf, b"", None
        return self._feed(raw, now) if raw else 0

    def _feed(self, raw: bytes, now: float) -> int:
        line = raw[: self.max_line].decode("utf-8", errors="replace")
        for li in self.listeners:
            self._call(li.feed_line, line, now)
        self.lines_fed += 1
        return 1

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one listener's bug must not starve the others
            name = getattr(fn, "__qualname__", repr(fn))
            n = self.listener_errors[name] = self.listener_errors.get(name, 0) + 1
            if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th ... failure: visible without flooding the journal
                log.exception("log_listener_failed", listener=name, failures=n)
